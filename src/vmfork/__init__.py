"""vmfork: fork(2) for microVMs.

Boot a parent Linux microVM once, warm it, snapshot it, and spawn children that
map its memory copy-on-write, each its own KVM virtual machine in its own process.
The package layout follows ``shared/DESIGN.md``: ``kvm`` (the KVM ABI), ``vmm``
(one microVM), ``ondisk`` (snapshot file formats, durable writes), ``image``
(building the guest), ``agent`` (PID 1 in the guest), ``store``, ``runtime``,
``server``, ``client``, ``cli`` and ``testhost``.
"""

__version__ = "0.1.0"
