"""The in-guest agent (PID 1) and its host-side client.

Everything in this package imports only the Python standard library: it is copied into
the guest as ``/opt/vmfork/vmfork/agent/`` next to ``vmfork/__init__.py`` and runs on the
guest's Debian python3.11. This ``__init__`` imports nothing so that ``/init`` pays only
for what it uses. ``protocol`` documents the wire format and every op; ``client`` is the
host side (``AgentClient``); ``server`` serves a listening socket; ``main`` is PID 1.
"""
