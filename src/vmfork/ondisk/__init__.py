"""vmfork's files on disk: their byte formats and how they are written durably.

Everything a snapshot is made of on disk is defined here, once, for every process
that reads or writes it -- the VMM (``vmfork.vmm``: capture writes, restore maps)
and the store (``vmfork.store``: publish, packs, pull, verify):

* ``stateformat`` -- ``state.bin``: versioned, checksummed, field-named machine
  state (and the JSON value codec ``meta.json`` reuses);
* ``layerfile`` -- ``layer.bin``: the pages a diff snapshot changed, with an index;
  and the kernel-side copies (``copy_file_range``, sparse copies) layers need;
* ``memplan`` -- ``memory.plan``: a chain's RAM as runs of its files;
* ``durable`` -- write to a temporary name, fsync the file, rename, fsync the
  directory: the only way a vmfork file replaces another or a name appears;
* ``readonly`` -- read-only inputs opened before a jailed VMM lost the right to;
* ``errors`` -- ``OnDiskError``, the root of what the modules above raise.

The package imports only the standard library (``tests/unit/test_import_graph.py``
checks it): both ``vmm`` and ``store`` build on it, so it can import neither, and a
process that only reads snapshots never drags in the KVM layer.
"""
