"""Module load order from modules.dep, kernel selection, module decompression."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path

import pytest

from vmfork.testhost import modules as kmod
from vmfork.testhost.errors import TesthostSetupError

# A trimmed copy of Debian 6.1's modules.dep, dependency lists in its order.
DEP_SAMPLE = """\
kernel/arch/x86/kvm/kvm.ko: kernel/virt/lib/irqbypass.ko
kernel/arch/x86/kvm/kvm-intel.ko: kernel/arch/x86/kvm/kvm.ko kernel/virt/lib/irqbypass.ko
kernel/arch/x86/kvm/kvm-amd.ko.xz: kernel/drivers/crypto/ccp/ccp.ko kernel/arch/x86/kvm/kvm.ko kernel/virt/lib/irqbypass.ko
kernel/fs/netfs/netfs.ko:
kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko
kernel/fs/overlayfs/overlay.ko:
kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko kernel/fs/netfs/netfs.ko
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio_pci_modern_dev.ko:
kernel/drivers/virtio/virtio_pci_legacy_dev.ko:
kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_legacy_dev.ko kernel/drivers/virtio/virtio_pci_modern_dev.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/crypto/ccp/ccp.ko:
kernel/drivers/net/tun.ko:
kernel/net/9p/9pnet.ko:
kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/virt/lib/irqbypass.ko:
kernel/drivers/vhost/vhost_vsock.ko: kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko kernel/drivers/vhost/vhost.ko kernel/drivers/vhost/vhost_iotlb.ko kernel/net/vmw_vsock/vsock.ko
kernel/drivers/vhost/vhost.ko: kernel/drivers/vhost/vhost_iotlb.ko
kernel/drivers/vhost/vhost_iotlb.ko:
kernel/net/vmw_vsock/vsock.ko:
kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko: kernel/net/vmw_vsock/vsock.ko
kernel/drivers/net/veth.ko:
kernel/net/netfilter/nfnetlink.ko:
kernel/lib/libcrc32c.ko:
kernel/crypto/crc32c_generic.ko:
kernel/net/netfilter/nf_tables.ko: kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/ipv4/netfilter/nf_defrag_ipv4.ko:
kernel/net/ipv6/netfilter/nf_defrag_ipv6.ko:
kernel/net/netfilter/nf_conntrack.ko: kernel/net/ipv6/netfilter/nf_defrag_ipv6.ko kernel/net/ipv4/netfilter/nf_defrag_ipv4.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nf_nat.ko: kernel/net/netfilter/nf_conntrack.ko kernel/net/ipv6/netfilter/nf_defrag_ipv6.ko kernel/net/ipv4/netfilter/nf_defrag_ipv4.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_chain_nat.ko: kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/net/netfilter/nf_nat.ko kernel/net/netfilter/nf_conntrack.ko kernel/net/ipv6/netfilter/nf_defrag_ipv6.ko kernel/net/ipv4/netfilter/nf_defrag_ipv4.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_nat.ko: kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/net/netfilter/nf_nat.ko kernel/net/netfilter/nf_conntrack.ko kernel/net/ipv6/netfilter/nf_defrag_ipv6.ko kernel/net/ipv4/netfilter/nf_defrag_ipv4.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_masq.ko: kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/net/netfilter/nf_nat.ko kernel/net/netfilter/nf_conntrack.ko kernel/net/ipv6/netfilter/nf_defrag_ipv6.ko kernel/net/ipv4/netfilter/nf_defrag_ipv4.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_ct.ko: kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/net/netfilter/nf_conntrack.ko kernel/net/ipv6/netfilter/nf_defrag_ipv6.ko kernel/net/ipv4/netfilter/nf_defrag_ipv4.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_fib.ko: kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/ipv4/netfilter/nft_fib_ipv4.ko: kernel/net/netfilter/nft_fib.ko kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_reject.ko: kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/ipv4/netfilter/nf_reject_ipv4.ko:
kernel/net/ipv4/netfilter/nft_reject_ipv4.ko: kernel/net/ipv4/netfilter/nf_reject_ipv4.ko kernel/net/netfilter/nft_reject.ko kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/ipv6/netfilter/nft_fib_ipv6.ko: kernel/net/netfilter/nft_fib.ko kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_fib_inet.ko: kernel/net/ipv4/netfilter/nft_fib_ipv4.ko kernel/net/ipv6/netfilter/nft_fib_ipv6.ko kernel/net/netfilter/nft_fib.ko kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/ipv6/netfilter/nf_reject_ipv6.ko:
kernel/net/netfilter/nft_reject_inet.ko: kernel/net/ipv4/netfilter/nf_reject_ipv4.ko kernel/net/ipv6/netfilter/nf_reject_ipv6.ko kernel/net/netfilter/nft_reject.ko kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
"""


def _deps(builtin: str = "") -> kmod.ModuleDeps:
    return kmod.ModuleDeps.parse(DEP_SAMPLE, builtin)


def _assert_topological(order: list[str], deps: kmod.ModuleDeps) -> None:
    for position, name in enumerate(order):
        for dep in deps.deps[name]:
            if dep not in deps.builtin:
                assert order.index(dep) < position, f"{dep} must load before {name}"


def test_module_names_normalise_dashes_and_suffixes() -> None:
    assert kmod.module_name("kernel/arch/x86/kvm/kvm-amd.ko.xz") == "kvm_amd"
    assert kmod.module_name("kernel/net/9p/9pnet_virtio.ko.zst") == "9pnet_virtio"
    assert kmod.module_name("a/b/overlay.ko") == "overlay"


def test_load_order_of_the_real_module_table() -> None:
    deps = _deps()
    order = deps.load_order(kmod.wanted_modules())
    _assert_topological(order, deps)
    assert set(order) == {
        "virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci",
        "9pnet", "9pnet_virtio", "netfs", "fscache", "9p", "overlay", "virtio_console",
        "irqbypass", "kvm", "ccp", "kvm_amd",
        "vsock", "vmw_vsock_virtio_transport_common", "vhost_iotlb", "vhost", "vhost_vsock",
        "tun", "veth", "crc32c_generic", "nfnetlink", "libcrc32c", "nf_tables", "nf_defrag_ipv4",
        "nf_defrag_ipv6", "nf_conntrack", "nf_nat", "nft_chain_nat", "nft_nat", "nft_masq",
        "nft_ct", "nft_fib", "nft_fib_ipv4", "nft_reject", "nf_reject_ipv4", "nft_reject_ipv4",
        "nft_fib_ipv6", "nft_fib_inet", "nf_reject_ipv6", "nft_reject_inet",
    }
    assert "kvm_intel" not in order
    assert order.index("crc32c_generic") < order.index("libcrc32c"), "libcrc32c's softdep"


def test_a_misordered_wish_list_still_loads_dependencies_first() -> None:
    deps = _deps()
    order = deps.load_order(["kvm-amd", "9p", "virtio_ring"])
    _assert_topological(order, deps)
    assert order.count("kvm") == 1 and order.index("irqbypass") < order.index("kvm")


def test_builtin_modules_are_skipped() -> None:
    deps = _deps(builtin="kernel/drivers/virtio/virtio.ko\nkernel/drivers/virtio/virtio_ring.ko\n")
    order = deps.load_order(["virtio_pci"])
    assert order == ["virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio_pci"]
    assert deps.provides("virtio")


def test_unknown_module_names_who_needed_it() -> None:
    deps = kmod.ModuleDeps.parse("kernel/a.ko: kernel/missing.ko\n")
    with pytest.raises(KeyError, match="missing.*needed by a"):
        deps.load_order(["a"])


def test_dependency_cycle_is_reported() -> None:
    deps = kmod.ModuleDeps.parse("a.ko: b.ko\nb.ko: a.ko\n")
    with pytest.raises(ValueError, match="cycle"):
        deps.load_order(["a"])


def test_malformed_line_is_reported() -> None:
    with pytest.raises(ValueError, match="line 2"):
        kmod.ModuleDeps.parse("a.ko:\nno colon here\n")


def test_version_key_orders_abi_numbers_numerically() -> None:
    versions = ["6.1.0-9-amd64", "6.1.0-57-amd64", "6.1.0-10-amd64", "5.10.0-30-amd64"]
    assert max(versions, key=kmod.version_key) == "6.1.0-57-amd64"
    assert min(versions, key=kmod.version_key) == "5.10.0-30-amd64"


def _install(root: Path, version: str, dep_text: str) -> None:
    (root / "boot").mkdir(exist_ok=True)
    (root / "boot" / f"vmlinuz-{version}").write_bytes(b"kernel")
    tree = root / "lib/modules" / version
    tree.mkdir(parents=True)
    (tree / "modules.dep").write_text(dep_text)


def test_find_kernel_prefers_the_newest_that_has_every_module(tmp_path: Path) -> None:
    _install(tmp_path, "6.1.0-50-amd64", DEP_SAMPLE)
    _install(tmp_path, "6.1.0-57-amd64", DEP_SAMPLE)
    _install(tmp_path, "6.1.0-60-cloud-amd64", "kernel/fs/overlayfs/overlay.ko:\n")
    kernel = kmod.find_kernel(kmod.wanted_modules(), tmp_path / "boot", tmp_path / "lib/modules")
    assert kernel.version == "6.1.0-57-amd64"
    assert kernel.vmlinuz == tmp_path / "boot/vmlinuz-6.1.0-57-amd64"


def test_find_kernel_names_the_package_when_nothing_fits(tmp_path: Path) -> None:
    _install(tmp_path, "6.1.0-60-cloud-amd64", "kernel/fs/overlayfs/overlay.ko:\n")
    with pytest.raises(TesthostSetupError, match="6.1.0-60-cloud-amd64 lacks .*linux-image-amd64"):
        kmod.find_kernel(["overlay", "9p"], tmp_path / "boot", tmp_path / "lib/modules")
    with pytest.raises(TesthostSetupError, match="apt-get install linux-image-amd64"):
        kmod.find_kernel(["9p"], tmp_path / "none", tmp_path / "none")


def test_read_module_decompresses(tmp_path: Path) -> None:
    elf = b"\x7fELF" + bytes(range(200))
    (tmp_path / "a.ko").write_bytes(elf)
    (tmp_path / "b.ko.xz").write_bytes(lzma.compress(elf, format=lzma.FORMAT_XZ))
    (tmp_path / "c.ko.gz").write_bytes(gzip.compress(elf))
    for name in ("a.ko", "b.ko.xz", "c.ko.gz"):
        assert kmod.read_module(tmp_path / name) == elf

