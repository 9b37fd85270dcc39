// An E2B program in JavaScript, unmodified E2B SDK calls only (`e2b` from the package
// registry, scripts/lib.sh setup_e2b_sdk): where it runs is set by the environment
// (E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL). Run by the tests as
//   NODE_PATH=<the SDK's node_modules> node tour.cjs TEMPLATE WORKDIR
// It prints one JSON object of what it saw, with the keys tour.py prints.
const { Sandbox, CommandExitError } = require('e2b')

async function main () {
  const [template, work] = process.argv.slice(2)
  const seen = {}
  const sandbox = await Sandbox.create(template)
  seen.id = sandbox.sandboxId
  try {
    await sandbox.files.makeDir(work)
    const chunks = []
    const result = await sandbox.commands.run('echo hello; echo oops >&2; printf "$GREETING"',
      { envs: { GREETING: 'hi-env' }, cwd: work, onStdout: (d) => chunks.push(d) })
    seen.run = { stdout: result.stdout, stderr: result.stderr, exit_code: result.exitCode, chunks }
    seen.pwd = (await sandbox.commands.run('pwd', { cwd: work })).stdout
    try {
      await sandbox.commands.run('exit 3')
      seen.exit3 = null
    } catch (err) {
      seen.exit3 = err instanceof CommandExitError ? err.exitCode : String(err)
    }

    let echoed = ''
    const cat = await sandbox.commands.run('cat', { background: true, stdin: true,
      onStdout: (d) => { echoed += d } })
    await sandbox.commands.sendStdin(cat.pid, 'from stdin\n')
    const deadline = Date.now() + 30000
    while (!echoed.includes('from stdin') && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 100))
    }
    seen.echoed = echoed.includes('from stdin')
    seen.listed_cat = (await sandbox.commands.list()).some((p) => p.pid === cat.pid)
    seen.killed = await sandbox.commands.kill(cat.pid)
    try {
      await cat.wait()
      seen.cat_end = 'exited'
    } catch (err) {
      seen.cat_end = { exit_code: err.exitCode, stdout: err.stdout, error: err.error }
    }

    const sleeper = await sandbox.commands.run('sleep 1; echo woke', { background: true })
    const again = await sandbox.commands.connect(sleeper.pid)
    seen.reconnected = (await again.wait()).stdout

    await sandbox.files.write(`${work}/a.txt`, 'alpha')
    seen.read = await sandbox.files.read(`${work}/a.txt`)
    seen.read_bytes = Array.from(await sandbox.files.read(`${work}/a.txt`, { format: 'bytes' }))
    seen.exists = [await sandbox.files.exists(`${work}/a.txt`),
      await sandbox.files.exists(`${work}/nope`)]
    seen.made = [await sandbox.files.makeDir(`${work}/sub/deeper`),
      await sandbox.files.makeDir(`${work}/sub/deeper`)]
    seen.renamed = (await sandbox.files.rename(`${work}/a.txt`, `${work}/sub/b.txt`)).path
    const entries = await sandbox.files.list(`${work}/sub`)
    seen.list = entries.map((e) => [e.name, e.type === 'dir']).sort()
    seen.info_size = (await sandbox.files.getInfo(`${work}/sub/b.txt`)).size
    await sandbox.files.remove(`${work}/sub/b.txt`)
    seen.removed = !(await sandbox.files.exists(`${work}/sub/b.txt`))
    const big = 'x'.repeat(3 << 20)
    await sandbox.files.write(`${work}/big.txt`, big)
    seen.big = (await sandbox.files.read(`${work}/big.txt`)) === big

    const events = []
    const handle = await sandbox.files.watchDir(work, (e) => events.push([e.name, e.type]))
    await sandbox.files.write(`${work}/watched.txt`, 'w')
    const until = Date.now() + 10000
    while (!events.some(([n]) => n === 'watched.txt') && Date.now() < until) {
      await new Promise((resolve) => setTimeout(resolve, 100))
    }
    await handle.stop()
    seen.watch = events

    let ptyOut = ''
    const decoder = new TextDecoder()
    const terminal = await sandbox.pty.create({ rows: 24, cols: 80, cwd: work,
      onData: (d) => { ptyOut += decoder.decode(d, { stream: true }) } })
    await sandbox.pty.resize(terminal.pid, { rows: 30, cols: 100 })
    await sandbox.pty.sendInput(terminal.pid, new TextEncoder().encode('stty size; exit\n'))
    try { await terminal.wait() } catch (err) { }
    seen.pty = ptyOut

    const paginator = Sandbox.list()
    seen.listed = (await paginator.nextItems()).some((s) => s.sandboxId === sandbox.sandboxId)
    seen.running = await sandbox.isRunning()
    const other = await Sandbox.connect(sandbox.sandboxId)
    seen.connected_run = (await other.commands.run('echo again')).stdout

    await sandbox.files.write(`${work}/before-fork.txt`, 'kept')
    const forks = await sandbox.fork({ count: 2 })
    seen.forks = []
    for (const fork of forks) {
      seen.forks.push(fork instanceof Error ? String(fork) : await fork.files.read(`${work}/before-fork.txt`))
    }
    seen.forks_distinct = new Set([sandbox.sandboxId, ...forks.map((f) => f.sandboxId)]).size
    for (const fork of forks) { if (!(fork instanceof Error)) await fork.kill() }
  } finally {
    seen.kill = await sandbox.kill()
  }
  const after = await Sandbox.list().nextItems()
  seen.listed_after_kill = after.some((s) => s.sandboxId === sandbox.sandboxId)
  console.log(JSON.stringify(seen))
}

main().catch((err) => { console.error(err); process.exit(1) })
