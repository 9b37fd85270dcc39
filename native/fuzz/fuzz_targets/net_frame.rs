//! virtio-net's frame paths against arbitrary guest memory, queue registers and host
//! frames: whatever the descriptor tables, rings and lengths hold, a tx run and an rx
//! run each end (no hang: libFuzzer's timeout catches one), fail only as a guest error,
//! stay within their budget, put one used entry per chain they report, send only frames
//! longer than the vnet header and at most the size limit (each whole, as one datagram),
//! and hand the guest only frames that fit its chain, `num_buffers` set. The fd is real:
//! an AF_UNIX datagram socket pair, a frame per datagram as on a tap, its send buffer
//! sometimes the kernel's least (so writes also fail with EAGAIN).
#![no_main]

#[path = "common/guest_image.rs"]
mod guest_image;
#[allow(dead_code)]
#[path = "../../src/guest_ram.rs"]
mod guest_ram;
#[allow(dead_code)]
#[path = "../../src/net.rs"]
mod net;
#[allow(dead_code)]
#[path = "../../src/virtq.rs"]
mod virtq;

use guest_image::{rings, GuestImage};
use libfuzzer_sys::fuzz_target;

/// A non-blocking datagram socket pair (device end, host end).
fn dgram_pair(small_sndbuf: bool) -> (i32, i32) {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair");
    if small_sndbuf {
        let one: libc::c_int = 1;
        // SAFETY: `one` outlives the call, which reads an int from it.
        unsafe {
            libc::setsockopt(
                fds[0],
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
    (fds[0], fds[1])
}

/// The datagrams waiting on `fd`.
fn drain(fd: i32) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let mut buf = vec![0u8; 1 << 17];
        // SAFETY: `buf` is ours; recv writes at most its length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return out;
        }
        buf.truncate(n as usize);
        out.push(buf);
    }
}

fuzz_target!(|input: &[u8]| {
    if input.len() < 72 {
        return;
    }
    let (head, rest) = input.split_at(72);
    let (tx_rings, rx_rings) = (rings(head, 0), rings(head, 32));
    let next_avail = u16::from_le_bytes([head[1], head[2]]);
    let flags = head[64];
    let max_frames = u32::from(head[65] % 20);
    let max_tx_bytes = u64::from(u16::from_le_bytes([head[66], head[67]]));
    // Host frames to receive: `count` of them, lengths from the input, bytes from it too.
    let count = usize::from(head[68] % 8);
    let frame_len = usize::from(u16::from_le_bytes([head[69], head[70]]) % 4096);
    let (frames, image) = rest.split_at(rest.len().min(count * 8));
    let guest = GuestImage::new(image);
    let r = guest.ram().lock().unwrap();
    let (dev, host) = dgram_pair(flags & 1 != 0);

    if virtq::validate(&r, &tx_rings, 256).is_ok() {
        let fd = (flags & 2 == 0).then_some(dev);
        let s = net::transmit(
            &r,
            &tx_rings,
            next_avail,
            next_avail,
            fd,
            max_frames,
            max_tx_bytes,
        );
        assert!(s.chains <= max_frames);
        assert_eq!(u32::from(s.next_used.wrapping_sub(next_avail)), s.chains);
        let c = s.counters;
        assert_eq!(c.tx_frames + c.tx_dropped, u64::from(s.chains));
        let sent = drain(host);
        assert_eq!(sent.len() as u64, c.tx_frames, "a frame per datagram");
        let mut bytes = 0u64;
        for frame in &sent {
            let len = frame.len() as u64;
            assert!(len > net::VNET_HDR_SIZE && len <= max_tx_bytes, "{len}");
            bytes += len - net::VNET_HDR_SIZE;
        }
        assert_eq!(bytes, c.tx_bytes);
    }

    if virtq::validate(&r, &rx_rings, 256).is_ok() {
        for k in 0..frames.len() / 8 {
            let len = (frame_len + usize::from(frames[8 * k]) * 16) % 4096;
            let frame: Vec<u8> = (0..len).map(|i| frames[8 * k + 1 + i % 7]).collect();
            // SAFETY: `frame` is ours; send only reads it. A full queue refuses it.
            unsafe { libc::send(host, frame.as_ptr().cast(), frame.len(), 0) };
        }
        let fd = if flags & 4 != 0 { -1 } else { dev };
        let s = net::receive(&r, &rx_rings, next_avail, next_avail, fd, max_frames);
        assert!(s.delivered <= max_frames);
        assert_eq!(u32::from(s.next_used.wrapping_sub(next_avail)), s.delivered);
        let c = s.counters;
        assert!(c.rx_frames >= u64::from(s.delivered));
        assert!(c.rx_frames + c.rx_dropped <= u64::from(max_frames));
        if s.error.is_none() {
            assert_eq!(s.next_avail, s.next_used, "only filled chains are consumed");
        }
        if fd < 0 {
            assert_eq!(s.delivered, 0);
        }
    }
    // SAFETY: our descriptors, closed once.
    unsafe {
        libc::close(dev);
        libc::close(host);
    }
});
