// An E2B program in JavaScript: the SDK's signed file URLs (downloadUrl, uploadUrl,
// useSignatureExpiration), fetched with plain fetch as another service would. Run by
// the tests as
//   NODE_PATH=<the SDK's node_modules> node signed_urls.cjs TEMPLATE WORKDIR
// A URL made under E2B_SANDBOX_URL names no sandbox, so each fetch sends the
// E2b-Sandbox-Id header (signed_urls.py also tries the Host form). Prints one JSON object.
const { Sandbox } = require('e2b')

async function get (url, sandboxId, init = {}) {
  const r = await fetch(url, { ...init, headers: { ...(init.headers || {}), 'E2b-Sandbox-Id': sandboxId } })
  const text = await r.text()
  let body = text
  if (r.status !== 200) { try { body = JSON.parse(text).message } catch (e) {} }
  return { status: r.status, body }
}

async function main () {
  const [template, work] = process.argv.slice(2)
  const seen = {}
  const sandbox = await Sandbox.create(template)
  try {
    const path = `${work}/signed-js.txt`
    await sandbox.files.write(path, 'signed from js')
    seen.plain = await get(await sandbox.downloadUrl(path), sandbox.sandboxId)
    seen.expiring = await get(await sandbox.downloadUrl(path, { useSignatureExpiration: 120 }),
      sandbox.sandboxId)
    seen.expired = await get(await sandbox.downloadUrl(path, { useSignatureExpiration: -30 }),
      sandbox.sandboxId)
    const form = new FormData()
    form.append('file', new Blob(['uploaded from js']), 'uploaded-js.txt')
    const upload = await sandbox.uploadUrl(`${work}/uploaded-js.txt`, { useSignatureExpiration: 120 })
    seen.upload = await get(upload, sandbox.sandboxId, { method: 'POST', body: form })
    seen.uploaded = await sandbox.files.read(`${work}/uploaded-js.txt`)
    seen.write_url_read = await get(upload, sandbox.sandboxId)
  } finally {
    await sandbox.kill()
  }
  console.log(JSON.stringify(seen))
}

main().catch((err) => { console.error(err); process.exit(1) })
