#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/).

    tests/fuzz/make_seeds.py        # rewrites the seed-* files

The seeds are small, valid or nearly valid inputs from which libFuzzer
starts: hellos, authenticated-setup messages, one header of each type, and
engine sequences that reach
the states a fuzzer is slow to find alone (a rendezvous answered and
written, OPEN then CLOSE, a completion error in mid-rendezvous, ...).
Regression inputs (regress-*) are written by hand from crashes and are not
touched here. The engine's input format is in tests/fuzz/fuzz_engine.c; the
operation numbers below must match its OP_* enum.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# ---------------- hello (network byte order, 80 bytes) ----------------
def hello(flags=0, qpn=0x1234, psn=7, gid=b"\xfe\x80" + bytes(13) + b"\x01", mtu=5,
          rd_atomic=16, recv_depth=64, sq_depth=32, max_msg=1 << 31, frag=65536,
          conn_id=0x1122334455667788, eager=8192, ka_addr=0x7F0000001000, ka_rkey=0x55,
          max_rndv=256, ka_timeout=2000, magic=0x42455848, version=4, length=80):
    b = struct.pack(">IHHIII16sBBHHHIIQIQIHH", magic, version, length, flags, qpn, psn, gid,
                    mtu, rd_atomic, recv_depth, sq_depth, ka_timeout, max_msg, frag, conn_id, eager,
                    ka_addr, ka_rkey, max_rndv, 0)
    assert len(b) == 80
    return b


write("hello", "rdma", hello())
write("hello", "srq", hello(flags=2, recv_depth=1))
write("hello", "no-rdma", hello(flags=1, qpn=0, psn=0, gid=bytes(16), mtu=0, rd_atomic=0,
                                recv_depth=0, sq_depth=0, frag=0, eager=0, ka_addr=0,
                                ka_rkey=0, max_rndv=0))
write("hello", "limits", hello(qpn=0xFFFFFF, psn=0xFFFFFF, mtu=1, recv_depth=65535,
                               sq_depth=1, max_msg=1, frag=256, eager=1 << 20, max_rndv=1))
write("hello", "bad-magic", b"GET / HTTP/1.1\r\n" + bytes(64))
write("hello", "bad-version", hello(version=2))
write("hello", "old-version", hello(version=1))  # from before DATA went header-free
write("hello", "v3", hello(version=3, ka_timeout=0))  # from before the keepalive timeout
write("hello", "ka-timeout-zero", hello(ka_timeout=0))
write("hello", "short", hello()[:40])


# ---------------- authenticated setup (version 2, network byte order) ----------------
def auth(typ, body, version=2):
    return struct.pack(">IHHB3x", 0x42455848, version, 12 + len(body), typ) + body


write("setup", "open", auth(1, bytes(range(32))))
write("setup", "challenge", auth(2, bytes(range(32, 64))))
write("setup", "proof", auth(3, bytes(32)))
write("setup", "hello", auth(4, hello() + bytes(range(32))))
write("setup", "plain-hello", hello())
write("setup", "notice", struct.pack(">II", 0x42455852, 0))
write("setup", "refusal", struct.pack(">II", 0x42455852, 13))
write("setup", "bad-length", auth(1, bytes(40)))


# ---------------- header (little-endian, 32 bytes + payload) ----------------
def hdr(typ, credits=0, stream=0, length=0, ident=0, addr=0, rkey=0, status=0, flags=0):
    return struct.pack("<BBHIIIQIi", typ, flags, credits, stream, length, ident, addr, rkey,
                       status)


# DATA has a header only on a stream the immediate cannot name (> 2^20 - 1)
IMM_STREAM_MAX = (1 << 20) - 1
write("hdr", "data", hdr(1, credits=3, stream=IMM_STREAM_MAX + 5, length=11) + b"hello world")
write("hdr", "data-empty", hdr(1, stream=IMM_STREAM_MAX + 1))
write("hdr", "data-small-stream", hdr(1, stream=5, length=2) + b"hi")  # refused
write("hdr", "rndv-req", hdr(2, stream=5, length=1 << 20, ident=(1 << 16) | 3))
write("hdr", "rndv-resp", hdr(3, stream=(1 << 16) | 3, ident=(1 << 16) | 3,
                              addr=0x7F0012345000, rkey=0x1234))
write("hdr", "rndv-resp-err", hdr(3, ident=(1 << 16) | 3, status=-12))
write("hdr", "credit", hdr(4, credits=32))
write("hdr", "open", hdr(5, stream=9))
write("hdr", "close", hdr(6, stream=9))

# ---------------- engine: config prefix, then operations ----------------
(OP_RECV_RAW, OP_RECV_DATA, OP_RECV_REQ, OP_RECV_RESP, OP_RECV_CREDIT, OP_RECV_OPEN,
 OP_RECV_CLOSE, OP_WRITE_GRANT, OP_WRITE_IMM, OP_SEND_OK, OP_NIC_ERROR, OP_APP_OPEN,
 OP_APP_SEND, OP_APP_CLOSE, OP_TICK, OP_KEEPALIVE, OP_FAIL, OP_INJECT, OP_EXPOSE, OP_START,
 OP_REPEAT, OP_RECV_IMM) = range(22)


def imm(stream, credits, kind=1):
    """The immediate of a header-free DATA (host order; the target sends it
    in network order): kind 31..30, stream 29..10, credits 9..0."""
    return kind << 30 | stream << 10 | credits


def cfg(client=False, rxe=False, sq=16, rq=8, eager=5, frag=1, window=0, ahead=4,
        peer_rq=16, peer_rndv=8, peer_eager=256, windows=False, big_ids=False):
    """eager: index into the target's table (5 = 1024); frag: 256 << frag;
    windows: memory-window mode (destinations reached through bound windows);
    big_ids: stream ids start 3 below the immediate's limit (ids from the
    input are that base + a byte)."""
    b = bytes([(1 if client else 0) | (2 if rxe else 0) | (64 if windows else 0) |
               (128 if big_ids else 0),
               sq.bit_length() - 2, rq - 4, eager,
               frag | (window << 3), ahead])
    return b + struct.pack("<HHI", peer_rq, peer_rndv, peer_eager)


def op(code, *args):
    out = bytes([code])
    for kind, v in args:
        out += struct.pack({"b": "<B", "h": "<H", "i": "<I"}[kind], v)
    return out


B, H, I = "b", "h", "i"
start = op(OP_START)

# server: a stream opens, data both ways, the peer closes it
write("engine", "open-data-close", cfg() + start + op(OP_RECV_OPEN, (B, 1), (B, 0)) +
      op(OP_RECV_DATA, (B, 1), (B, 0), (H, 100)) + op(OP_APP_SEND, (B, 0), (H, 50), (B, 0), (B, 0)) +
      op(OP_SEND_OK) + op(OP_RECV_CLOSE, (B, 1), (B, 1)))
# server: the peer asks for a destination, gets it, writes into it
write("engine", "rndv-in", cfg() + start + op(OP_RECV_OPEN, (B, 2), (B, 0)) +
      op(OP_RECV_REQ, (B, 2), (B, 0), (I, 3000), (I, 0x10007)) + op(OP_SEND_OK) +
      op(OP_WRITE_GRANT, (B, 0)) + op(OP_WRITE_GRANT, (B, 0)))
# the same in window mode: the window is bound before the answer leaves,
# invalidated after the delivery; then the QP fails with a window bound
write("engine", "window-rndv-in", cfg(windows=True) + start + op(OP_RECV_OPEN, (B, 2), (B, 0)) +
      op(OP_RECV_REQ, (B, 2), (B, 0), (I, 3000), (I, 0x10007)) + op(OP_SEND_OK) +
      op(OP_WRITE_GRANT, (B, 0)) + op(OP_SEND_OK) +
      op(OP_RECV_REQ, (B, 2), (B, 0), (I, 9000), (I, 0x10008)) + op(OP_SEND_OK) +
      op(OP_RECV_REQ, (B, 2), (B, 0), (I, 5000), (I, 0x10009)) + op(OP_NIC_ERROR, (B, 0)))
# client: a small and a large message, the peer answers, the stream closes
write("engine", "rndv-out", cfg(client=True) + start + op(OP_APP_OPEN) +
      op(OP_APP_SEND, (B, 0), (H, 100), (B, 0), (B, 0)) +
      op(OP_APP_SEND, (B, 0), (H, 3000), (B, 2), (B, 0)) + op(OP_SEND_OK) +
      op(OP_RECV_RESP, (B, 0), (B, 0), (B, 1), (I, 0x99), (I, 0x10000)) +
      op(OP_SEND_OK) + op(OP_SEND_OK) + op(OP_APP_CLOSE, (B, 0)) + op(OP_SEND_OK) +
      op(OP_SEND_OK))
# client: the peer refuses the rendezvous (status -ENOMEM)
write("engine", "rndv-refused", cfg(client=True) + start + op(OP_APP_OPEN) +
      op(OP_APP_SEND, (B, 0), (H, 5000), (B, 4), (B, 0)) + op(OP_SEND_OK) +
      op(OP_RECV_RESP, (B, 0), (B, 0x80 | 12), (B, 1), (I, 0), (I, 0)) + op(OP_SEND_OK))
# client: a completion error in the middle of a rendezvous
write("engine", "error-mid-rndv", cfg(client=True, frag=0) + start + op(OP_APP_OPEN) +
      op(OP_APP_SEND, (B, 0), (H, 4000), (B, 6), (B, 0)) + op(OP_SEND_OK) +
      op(OP_RECV_RESP, (B, 0), (B, 0), (B, 1), (I, 0x42), (I, 0x20001)) +
      op(OP_NIC_ERROR, (B, 0)))
# the same on rxe: the receive drain marker never completes, the timeout ends it
write("engine", "rxe-drain", cfg(client=True, rxe=True) + start + op(OP_APP_OPEN) +
      op(OP_APP_SEND, (B, 0), (H, 10), (B, 8), (B, 0)) + op(OP_NIC_ERROR, (B, 2)) +
      op(OP_TICK, (H, 1500)))
# credits: more back than ever granted
write("engine", "credit-overflow", cfg() + start + op(OP_RECV_CREDIT, (H, 65535)))
# keepalive: the peer's writes keep it alive, then silence
write("engine", "keepalive", cfg() + start + op(OP_TICK, (H, 150)) + op(OP_KEEPALIVE) +
      op(OP_TICK, (H, 1500)) + op(OP_KEEPALIVE) + op(OP_SEND_OK) + op(OP_TICK, (H, 2500)) +
      op(OP_TICK, (H, 2500)))
# a stream opened twice
write("engine", "open-twice", cfg() + start + op(OP_RECV_OPEN, (B, 3), (B, 0)) +
      op(OP_RECV_OPEN, (B, 3), (B, 0)))
# exposed buffers: a direct send out, a direct write in
write("engine", "direct", cfg(client=True) + start + op(OP_APP_OPEN) +
      op(OP_APP_SEND, (B, 0), (H, 700), (B, 1), (B, 3)) + op(OP_SEND_OK) +
      op(OP_EXPOSE, (H, 5)) + op(OP_WRITE_IMM, (I, 0x80000005)) + op(OP_SEND_OK))
# a failed post
write("engine", "post-fails", cfg() + start + op(OP_RECV_OPEN, (B, 1), (B, 0)) +
      op(OP_INJECT, (B, 0)) + op(OP_APP_SEND, (B, 0), (H, 10), (B, 0), (B, 0)))
# many requests answered with errors while no credit comes back
write("engine", "many-reqs", cfg(peer_rq=4) + start +
      op(OP_REPEAT, (B, 40)) + op(OP_RECV_REQ, (B, 1), (B, 0), (I, 0x80000000), (I, 5)))
# small queues, a window, the stream closed while its message is in flight
write("engine", "tight", cfg(client=True, sq=2, rq=4, eager=2, window=1, ahead=1, peer_rq=3) +
      start + op(OP_APP_OPEN) + op(OP_APP_SEND, (B, 0), (H, 600), (B, 0), (B, 0)) +
      op(OP_RECV_RESP, (B, 0), (B, 0), (B, 2), (I, 7), (I, 0x10001)) +
      op(OP_APP_CLOSE, (B, 0)) + op(OP_SEND_OK) + op(OP_RECV_CREDIT, (H, 2)) + op(OP_SEND_OK))

# DATA of both encodings both ways: streams on either side of the
# immediate's limit (base 2^20 - 4: bytes 0..3 header-free, 4.. with header)
write("engine", "data-encodings", cfg(big_ids=True) + start +
      op(OP_RECV_OPEN, (B, 2), (B, 0)) + op(OP_RECV_OPEN, (B, 6), (B, 0)) +
      op(OP_RECV_DATA, (B, 2), (B, 0), (H, 100)) + op(OP_RECV_DATA, (B, 6), (B, 0), (H, 100)) +
      op(OP_RECV_DATA, (B, 6), (B, 0), (H, 0)) +
      op(OP_APP_SEND, (B, 0), (H, 50), (B, 0), (B, 0)) +
      op(OP_APP_SEND, (B, 1), (H, 50), (B, 0), (B, 0)) +
      op(OP_APP_SEND, (B, 1), (H, 240), (B, 0), (B, 0)) + op(OP_SEND_OK) + op(OP_SEND_OK))
write("engine", "data-encodings-client", cfg(client=True, big_ids=True) + start +
      op(OP_REPEAT, (B, 6)) + op(OP_APP_OPEN) +
      op(OP_APP_SEND, (B, 1), (H, 10), (B, 0), (B, 0)) +
      op(OP_APP_SEND, (B, 5), (H, 10), (B, 0), (B, 0)) +
      op(OP_APP_SEND, (B, 5), (H, 0), (B, 0), (B, 0)) + op(OP_REPEAT, (B, 12)) + op(OP_SEND_OK))
# header-free DATA the peer should not send: a reserved kind, then (on a
# fresh input) one returning more credits than were granted
write("engine", "imm-bad-kind", cfg() + start + op(OP_RECV_OPEN, (B, 1), (B, 0)) +
      op(OP_RECV_IMM, (I, imm(1, 0, kind=2)), (H, 8)))
write("engine", "imm-credit-overflow", cfg() + start + op(OP_RECV_OPEN, (B, 1), (B, 0)) +
      op(OP_RECV_IMM, (I, imm(1, 1023)), (H, 8)))
# header-free DATA on a stream nobody opened
write("engine", "imm-unknown-stream", cfg() + start + op(OP_RECV_IMM, (I, imm(77, 0)), (H, 3)))

# Regression inputs for bugs the engine target found (crafted; the ones
# libFuzzer wrote are committed as it wrote them).
def regress(name, data):
    d = os.path.join(HERE, "corpus", "engine")
    with open(os.path.join(d, "regress-" + name), "wb") as f:
        f.write(data)


# 275 rendezvous requests, each refused (too large) and none answered for
# want of credits: the answer queue (max_rndv + 8) overflowed an assert.
regress("answer-queue-overflow", cfg(peer_rq=2) + start +
        op(OP_REPEAT, (B, 255)) + op(OP_RECV_REQ, (B, 1), (B, 0), (I, 0x80000000), (I, 5)) +
        op(OP_REPEAT, (B, 20)) + op(OP_RECV_REQ, (B, 1), (B, 0), (I, 0x80000000), (I, 5)))
# An OPEN of a stream already open fails the engine from inside the upcall;
# the drain's receive cannot be posted, so the QP is released at once; the
# receive path then reposted receives on the released QP (NULL).
regress("repost-after-release", cfg(rq=8) + start + op(OP_RECV_OPEN, (B, 1), (B, 0)) +
        op(OP_RECV_DATA, (B, 1), (B, 0), (H, 5)) + op(OP_RECV_DATA, (B, 1), (B, 0), (H, 5)) +
        op(OP_INJECT, (B, 1)) + op(OP_RECV_OPEN, (B, 1), (B, 0)))
# A WRITE_WITH_IMM naming rendezvous slot 0, generation 1, while the answer
# granting it is still queued (our sends used up the peer's credits, none
# came back): the slot is guessable; the write must be refused (-EPROTO),
# never delivered. The input libFuzzer wrote no longer reached the bug once
# the target took limits and window mode from its mode byte.
regress("write-before-grant", cfg(peer_rq=4) + start + op(OP_RECV_OPEN, (B, 2), (B, 0)) +
        op(OP_REPEAT, (B, 4)) + op(OP_APP_SEND, (B, 0), (H, 10), (B, 0), (B, 0)) +
        op(OP_RECV_REQ, (B, 2), (B, 0), (I, 3000), (I, 0x10007)) +
        op(OP_WRITE_IMM, (I, 0x10000)) + op(OP_SEND_OK))


# ---------------- RPC header (little-endian, 64 bytes + body) ----------------
def rpc(kind, service=7, method=1, call_id=1, client_id=0x1122334455667788, seq=1, status=0,
        body=b"", timeout_ms=0, flags=0):
    return struct.pack("<HBBIIIQQQiII12x", 0xB5C1, 1, kind, flags, service, method, call_id,
                       client_id, seq, status, len(body), timeout_ms) + body


write("rpc", "request", rpc(1, body=b"hello", timeout_ms=40))
write("rpc", "request-empty", rpc(1, timeout_ms=40))
write("rpc", "response", rpc(2, body=bytes(range(32))))
write("rpc", "response-status", rpc(2, status=-11))
write("rpc", "error", rpc(3, status=-38))
write("rpc", "bad-length", rpc(1, body=b"abc", timeout_ms=40)[:-1])


# ---------------- PS request bodies (little-endian; fuzz_ps.c) ----------------
# The first byte picks the method (even: Fetch, odd: Push); then the body.
def ps(method, table, dim, keys, grads=None, version=1, push_id=None):
    b = struct.pack("<BxBxIII", version, 1 if push_id else 0, table, len(keys), dim)
    if push_id:
        b += struct.pack("<QQ", *push_id)  # flag ID: client, sequence
    b += b"".join(struct.pack("<Q", k) for k in keys)
    if grads is not None:
        b += b"".join(struct.pack("<f", g) for g in grads)
    return bytes([method]) + b


write("ps", "fetch", ps(0, 1, 4, [1, 2, 3]))
write("ps", "fetch-adagrad", ps(0, 2, 3, [7, 7]))
write("ps", "push-sgd", ps(1, 1, 4, [1, 5], [0.5] * 8))
write("ps", "push-adagrad", ps(1, 2, 3, [9, 9, 4], [1.0, -2.0, 0.25] * 3))
write("ps", "push-id", ps(1, 1, 4, [1, 5], [0.25] * 8, push_id=(0xC1, 7)))
write("ps", "push-nan", ps(1, 1, 4, [1], [float("nan")] * 4))
write("ps", "fetch-bad-length", ps(0, 1, 4, [1, 2])[:-3])


# ---------------- PS Cut bodies (little-endian; fuzz_pscut.c) ----------------
def pscut(op, cut_id, flags=0, extra=b""):
    return struct.pack("<BBBxIQ", 1, op, flags, 0, cut_id) + extra


write("pscut", "prepare", pscut(1, 42, flags=1))
write("pscut", "commit", pscut(2, 42))
write("pscut", "abort", pscut(3, 42))
write("pscut", "join", pscut(4, 7, extra=bytes([127, 0, 0, 1, 0x1f, 0x90, 2, 0])))
write("pscut", "joined", pscut(5, 7))
write("pscut", "id-zero", pscut(1, 0))
write("pscut", "bad-op", pscut(6, 1))
write("pscut", "short", pscut(1, 42)[:15])
