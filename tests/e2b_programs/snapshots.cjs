// The JavaScript twin of snapshots.py (unmodified `e2b` SDK calls only): createSnapshot
// (named and not), listSnapshots, Sandbox.create from a snapshot id, deleteSnapshot.
//   NODE_PATH=<the SDK's node_modules> node snapshots.cjs TEMPLATE WORKDIR
// It prints one JSON object with the keys snapshots.py prints (the JavaScript SDK has
// no filesystem-only mode: that key is given as the Python check expects it).
const { Sandbox, SandboxError } = require('e2b')

async function main () {
  const [template, work] = process.argv.slice(2)
  const seen = {}
  const sandbox = await Sandbox.create(template)
  let spawned = null
  try {
    await sandbox.files.write(`${work}/state.txt`, 'before the snapshot')
    const named = await sandbox.createSnapshot({ name: 'e2b-named-snapshot' })
    seen.named = { id: named.snapshotId, names: named.names }
    await sandbox.files.write(`${work}/state.txt`, 'after the snapshot')
    const unnamed = await Sandbox.createSnapshot(sandbox.sandboxId)
    seen.unnamed_differs = unnamed.snapshotId !== named.snapshotId
    seen.source_runs = await sandbox.isRunning()
    const mine = await sandbox.listSnapshots().nextItems()
    seen.mine = JSON.stringify(mine.map((s) => s.snapshotId).sort()) ===
      JSON.stringify([named.snapshotId, unnamed.snapshotId].sort())
    const everything = await Sandbox.listSnapshots().nextItems()
    seen.all_has_named = everything.some((s) => s.snapshotId === named.snapshotId)
    seen.by_name = (await Sandbox.listSnapshots({ name: named.snapshotId }).nextItems())
      .map((s) => s.snapshotId)
    const paged = Sandbox.listSnapshots({ sandboxId: sandbox.sandboxId, limit: 1 })
    const first = await paged.nextItems()
    const firstHasNext = paged.hasNext
    const second = await paged.nextItems()
    seen.paged = [first.length, firstHasNext, second.length, paged.hasNext]
    seen.filesystem_only = 'memory: false (no such option in the JavaScript SDK)'
    try {
      await sandbox.createSnapshot({ name: named.snapshotId })
      seen.name_taken = null
    } catch (err) {
      seen.name_taken = err instanceof SandboxError ? String(err.message) : `not SandboxError: ${err}`
    }

    spawned = await Sandbox.create(named.snapshotId)
    seen.spawned_reads = await spawned.files.read(`${work}/state.txt`)
    seen.spawned_template = (await spawned.getInfo()).templateId
    await spawned.kill()
    spawned = null
    seen.deleted = await Sandbox.deleteSnapshot(named.snapshotId)
    seen.deleted_again = await Sandbox.deleteSnapshot(named.snapshotId)
    seen.deleted_unnamed = await Sandbox.deleteSnapshot(unnamed.snapshotId)
    seen.left = (await sandbox.listSnapshots().nextItems()).map((s) => s.snapshotId)
    try {
      await Sandbox.create(named.snapshotId)
      seen.create_from_deleted = null
    } catch (err) {
      seen.create_from_deleted = err.name
    }
  } finally {
    if (spawned !== null) await spawned.kill()
    await sandbox.kill()
  }
  console.log(JSON.stringify(seen))
}

main().catch((err) => { console.error(err); process.exit(1) })
