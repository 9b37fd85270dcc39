"""The KVM ABI: ioctl numbers, ctypes structs, flat ioctl wrappers, probes.

Knows nothing of devices or guests. ``api`` holds one function per ioctl,
``structs`` the uapi structs, ``ioctls`` the request numbers, ``probe`` what this
host's KVM can do.
"""
