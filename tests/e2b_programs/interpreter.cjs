// An E2B code-interpreter program in JavaScript, unmodified `@e2b/code-interpreter` SDK
// calls only (scripts/lib.sh setup_e2b_sdk): where it runs is set by the environment
// (E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL). Run by the tests as
//   NODE_PATH=<the SDK's node_modules> node interpreter.cjs TEMPLATE
// It prints one JSON object of what it saw, with the keys interpreter.py prints.
const { Sandbox } = require('@e2b/code-interpreter')

async function main () {
  const seen = {}
  const sandbox = await Sandbox.create(process.argv[2])
  try {
    const chunks = []
    let run = await sandbox.runCode("x = 41\nprint('hello')\nimport sys\n" +
      "print('warn', file=sys.stderr)\nx + 1", { onStdout: (m) => chunks.push(m.line) })
    seen.value = { text: run.text, stdout: run.logs.stdout, stderr: run.logs.stderr, chunks,
      count: run.executionCount, error: run.error !== undefined && run.error !== null }
    seen.persists = (await sandbox.runCode('x * 2')).text
    run = await sandbox.runCode("def f():\n    raise ValueError('bad value')\nf()")
    seen.error = { name: run.error.name, value: run.error.value,
      traceback: run.error.traceback, text: run.text === undefined ? null : run.text }

    const stamps = []
    await sandbox.runCode("import time\nprint('first', flush=True)\ntime.sleep(1.5)\n" +
      "print('second')", { onStdout: () => stamps.push(performance.now() / 1000) })
    seen.streamed_gap = stamps.length === 2 ? stamps[1] - stamps[0] : null

    const context = await sandbox.createCodeContext({ cwd: '/tmp' })
    seen.context_cwd = context.cwd
    seen.context_sees_x = (await sandbox.runCode('x', { context })).error.name
    await sandbox.runCode("y = 'mine'", { context })
    seen.context_y = (await sandbox.runCode('y', { context })).text
    seen.default_sees_y = (await sandbox.runCode('y')).error.name
    seen.context_getcwd = (await sandbox.runCode('import os\nos.getcwd()', { context })).text
    seen.listed = (await sandbox.listCodeContexts()).some((c) => c.id === context.id)
    await sandbox.restartCodeContext(context)
    seen.after_restart = (await sandbox.runCode('y', { context })).error.name
    await sandbox.removeCodeContext(context)
    try {
      await sandbox.runCode('1', { context })
      seen.removed_context = null
    } catch (err) {
      seen.removed_context = String(err.message)
    }
    seen.env = (await sandbox.runCode("import os\nos.environ['CI_VAR']",
      { envs: { CI_VAR: 'from-envs' } })).text
    const rich = await sandbox.runCode("class Rich:\n    def __repr__(self): return 'Rich()'\n" +
      "    def _repr_html_(self): return '<b>rich</b>'\n" +
      "    def _repr_png_(self): return b'\\x89PNG-bytes'\nRich()")
    const r = rich.results[0]
    seen.rich = { text: r.text, html: r.html, png: r.png, formats: r.formats().sort() }
    const shown = await sandbox.runCode("print('before')\ndisplay(1)\n" +
      "display(Rich(), 'two')\n'end'")
    seen.displayed = {
      results: shown.results.map((x) => ({ text: x.text, html: x.html ?? null, main: x.isMainResult })),
      text: shown.text,
      stdout: shown.logs.stdout,
      error: shown.error ? [shown.error.name, shown.error.value] : null
    }
    try {
      await sandbox.runCode('while True: pass', { timeoutMs: 2000 })
      seen.timed_out = null
    } catch (err) {
      seen.timed_out = String(err.message)
    }
    const started = performance.now()
    seen.after_timeout = (await sandbox.runCode("'alive'")).text
    seen.after_timeout_secs = (performance.now() - started) / 1000
  } finally {
    await sandbox.kill()
  }
  console.log(JSON.stringify(seen))
  // The SDK leaves its request timer (60 s) running after a runCode that failed (the
  // removed context's 404), which would keep node alive that long.
  process.exit(0)
}

main().catch((err) => { console.error(err); process.exit(1) })
