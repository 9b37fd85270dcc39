"""The controller daemon (DESIGN.md decision 6): it owns sandbox and in-flight
snapshot state and serves the REST ``/v1`` API that forkd's users script against.

Layers, outermost first: ``http`` (sockets, HTTP framing, auth, audit, metrics per
request) → ``api`` (routes: validate, then call the controller) → ``controller``
(snapshots and sandboxes, through ``vmfork.store`` and a ``runtime.Runtime``) →
``registry`` (SQLite). ``daemon`` wires them together for ``vmfork serve``.
"""
