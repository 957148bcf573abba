/* SPDX-License-Identifier: Apache-2.0 */
/* bex sockets: logical connections over RDMA engines.
 *
 * A context (bex_ctx) owns the RDMA device that carries its local address
 * (none over TCP only), its protection domain, bemalloc pools registered
 * with it (general, received buffers, landing), and io_threads I/O threads
 * (bex_ctx_config.io_threads, default 1), each with the connections it
 * owns. A socket (bex_sock) is a logical connection, such as an RPC
 * channel. Sockets to the same listener (with the same transport choice)
 * share one connection and its transport: over RDMA one engine, an RC queue
 * pair with its work-request chain, receive buffers and credits; over TCP
 * one TCP connection. A round-robin scheduler interleaves the sockets of a
 * connection fragment by fragment.
 *
 * Delivery model: callbacks, run on the I/O thread of the socket's
 * connection (a context has io_threads of them; a socket's callbacks all run
 * on one, a listener's on_accept on the accepted socket's). A callback must
 * not block (it holds up every connection of its thread); it may call any
 * bex_sock_* function. Every other function may be called from any thread,
 * unless its comment says otherwise.
 *
 * Ownership (zero-copy): a buffer passed to bex_sock_send() must come from
 * bex_sock_alloc() (the context's bemalloc pool), bex_sock_alloc_exposable(),
 * or be a buffer this context received (any other is refused with -EINVAL
 * and a bex_last_error() text, checked, never a crash). It belongs to bex until
 * on_send_done reports it, with 0 or an error; then it is the caller's again.
 * A received buffer (on_recv) belongs to the application, which frees it
 * with bex_mem_free() from any thread, whenever it likes.
 *
 * Every message handed to bex_sock_send(), bex_sock_send_req() or
 * bex_sock_send_direct() that returned 0 is reported exactly once through
 * on_send_done, and only once the NIC no longer reads its buffer. Its
 * status says what became of it:
 *   0            delivered: the peer's engine holds it and hands it to
 *                its socket (unless that socket is closed by then). The
 *                peer says so (over RDMA the credit of its receive comes
 *                back, over TCP an acknowledgement), at the latest 1 ms
 *                (RDMA) or the peer's tcp_ack_delay_us (TCP, 200 us by
 *                default) after its arrival when the peer has nothing
 *                to send;
 *                a peer that never says so fails the connection after
 *                credit_timeout_ms, and the message comes back -EIO.
 *   -ECANCELED   not delivered, and never will be: it never left this host,
 *                or only fragments did that the peer drops (its last work
 *                request was never posted). Safe to send again.
 *   -EIO         in doubt: its last work request was posted, and the
 *                connection failed before the peer acknowledged it. It may
 *                or may not have arrived; only the application can tell.
 *   other        the peer refused it before any of it was written (its
 *                negative errno: -ENOMEM, no memory for it now; -EMSGSIZE,
 *                too large): not delivered.
 * Messages of one socket are delivered in the order they were sent. */
#ifndef BEX_SOCK_H
#define BEX_SOCK_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "bex/addr.h"
#include "bex/common.h"
#include "bex/mem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with -fvisibility=hidden: what is declared here is
 * its interface, everything else stays inside. */
#pragma GCC visibility push(default)

typedef struct bex_ctx bex_ctx;
typedef struct bex_sock bex_sock;
typedef struct bex_listener bex_listener;

/* How a peer reaches the memory it may write (rendezvous destinations,
 * exposed buffers). Both keep that memory in landing chunks that hold
 * payloads only (bex/mem.h). LANDING: the chunks are registered with remote
 * write and one key each. WINDOW: they carry no remote access; each
 * destination gets a type-2 memory window bound to it on its connection's
 * QP with a fresh key, revoked once the message is delivered. */
enum {
    BEX_REMOTE_ACCESS_AUTO = 0,
    BEX_REMOTE_ACCESS_LANDING = 1,
    BEX_REMOTE_ACCESS_WINDOW = 2,
};

/* Which transport carries a connection (bex_ctx_config.transport). AUTO:
 * RDMA when both sides have a usable device and the QP comes up, else TCP
 * on the same connection (a context without any device works on TCP
 * alone). RDMA: RDMA only (a peer without RDMA is refused; no device fails
 * bex_ctx_create with -ENODEV). TCP: TCP only (no device is opened). */
enum {
    BEX_TRANSPORT_AUTO = 0,
    BEX_TRANSPORT_RDMA = 1,
    BEX_TRANSPORT_TCP = 2,
};

/* How an I/O thread waits for work (bex_ctx_config.poll_mode). SPIN_SLEEP:
 * busy-poll for poll_spin_us after the last work, then sleep on the
 * completion channel and epoll. BUSY: never sleep (a core per I/O thread,
 * the lowest latency). EVENT: sleep as soon as there is nothing to do
 * (completion channel + epoll; an idle thread costs almost no CPU, each
 * wake-up costs latency). */
enum {
    BEX_POLL_SPIN_SLEEP = 0,
    BEX_POLL_BUSY = 1,
    BEX_POLL_EVENT = 2,
};

/* A three-way setting of bex_ctx_config (relaxed_ordering, thread_domains):
 * AUTO (0) is the field's default, which its comment names. */
enum {
    BEX_SWITCH_AUTO = 0,
    BEX_SWITCH_ON = 1,
    BEX_SWITCH_OFF = 2,
};

/* A poll mode by name, as programs take it on their command line
 * ("spin-sleep", "busy" or "event"). Returns 0 and sets *mode to its
 * BEX_POLL_*, or -EINVAL (name NULL or none of these; *mode unchanged). */
int bex_poll_mode_parse(const char *name, uint32_t *mode);

/* Check the environment's BEX_* settings (the table in
 * docs/configuration.md) without creating a context: 0 when every one set
 * has a good value, else -EINVAL and why (cap bytes, NUL-terminated) names
 * the variable, its value and what it may be. Programs call it before
 * starting anything, to refuse a bad value with that one line (exit
 * status 2); bex_ctx_create refuses the same values. Any thread. */
int bex_env_check(char *why, size_t cap);

/* Context configuration; zero in any field means its default. Some fields
 * can be set from the environment too, which then wins (BEX_LOG_LEVEL,
 * BEX_TRANSPORT, BEX_IO_THREADS, BEX_POLL_MODE, BEX_KEEPALIVE_MS,
 * BEX_KEEPALIVE_TIMEOUT_MS, BEX_CONNECT_TIMEOUT_MS, BEX_SRQ_DEPTH,
 * BEX_LOG_WINDOW_MS: the table is in docs/configuration.md). */
/* clang-format off */
#define BEX_CTX_CONFIG_INIT {.size = sizeof(bex_ctx_config)}
/* clang-format on */
typedef struct bex_ctx_config {
    size_t size; /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    /* The local address to use, IPv4 or IPv6 (its port is ignored); it
     * chooses the RDMA device, port and GID (RoCE: the GID that carries
     * it), and TCP connections leave from it. Required (the wildcard
     * address is refused with -EINVAL). */
    bex_addr local_addr;
    uint32_t sq_depth;             /* send-queue depth = work-request chain length (32;
                                      a power of two, 2..4096) */
    uint32_t rq_depth;             /* receive-queue depth d = initial credits (64) */
    uint32_t eager_max;            /* largest message sent by SEND (8192); larger ones
                                      use rendezvous + WRITE fragments */
    uint32_t frag_size;            /* WRITE fragment size (65536) */
    uint32_t send_window;          /* per-engine bytes in flight (Cwnd); 0 = off */
    uint32_t rndv_ahead;           /* rendezvous requests a socket may have
                                      outstanding ahead of its data (8) */
    uint32_t keepalive_ms;         /* keepalive interval (100) */
    uint32_t keepalive_timeout_ms; /* no peer progress for this long -> error (2000) */
    uint32_t connect_timeout_ms;   /* TCP connect + hello (3000) */
    uint32_t poll_spin_us;         /* busy-poll this long before sleeping (50) */
    uint8_t qp_timeout;            /* verbs local ACK timeout exponent (14) */
    uint8_t qp_retry_cnt;          /* transport retries (7; rxe: 7 retries forever) */
    uint8_t qp_rnr_retry;          /* RNR retries (7 = forever; credits keep RNR from
                                      happening with an honest peer; below 7 a peer that
                                      posts no receive for its credits fails the QP:
                                      -ENOBUFS, stats rnr_errors) */
    bex_mem_pool *pool;            /* use this pool (registered with this context's
                                      PD, see bex_ctx_pd, with local access only)
                                      instead of creating one */
    uint32_t remote_access;        /* how peers reach our memory: BEX_REMOTE_ACCESS_*
                                      (AUTO: WINDOW on devices with type-2 memory
                                      windows except rxe, else LANDING); see
                                      docs/security.md */
    bex_mem_pool *landing_pool;    /* use this landing pool (BEX_MEM_POOL_LANDING,
                                      registered with this context's PD with
                                      IBV_ACCESS_LOCAL_WRITE |
                                      IBV_ACCESS_REMOTE_WRITE, or with
                                      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND in
                                      window mode) for peer-writable memory instead
                                      of creating one */
    bex_log_fn log_fn;             /* where the library's log lines go (NULL: stderr,
                                      with a UTC timestamp, the level and the
                                      context's name) */
    void *log_arg;                 /* passed to log_fn */
    int log_level;                 /* highest BEX_LOG_* level passed on (BEX_LOG_WARN) */
    /* Shared cluster secret (BEX_SECRET_MIN..BEX_SECRET_MAX bytes, copied at
     * create). With one, a connection is set up only with a peer that proves
     * it holds the same secret, and nothing about our QPs or memory is sent
     * before it did (docs/protocol.md). NULL: the environment's BEX_SECRET
     * (the variable's bytes), else the key file named by BEX_SECRET_FILE
     * (bex_secret_load); none of them: connections are unauthenticated
     * (docs/security.md says what that exposes). An invalid secret, variable
     * or file fails bex_ctx_create with its error rather than running
     * without one. */
    const void *secret;
    size_t secret_len;
    /* Limits: what one peer, or all of them, may make this context hold.
     * docs/configuration.md says how each is enforced. */
    uint32_t max_msg;           /* largest message we accept, bytes (64 MiB; at most
                                   2 GiB - 1); told to the peer in the hello, whose own
                                   limit bounds our sends (-EMSGSIZE) */
    uint32_t rndv_max;          /* rendezvous requests a peer may have in flight to us
                                   (256; 1..32767); told to the peer */
    uint64_t rndv_bytes_max;    /* destination bytes we allocate for one peer at once
                                   (256 MiB); further requests wait for room */
    uint64_t recv_bytes_max;    /* received bytes the application holds (not yet
                                   freed) over the whole context (1 GiB); above it
                                   the engines stop returning credits; ~0 = no limit */
    uint64_t recv_share_min;    /* what a connection may always hold of memory its peer
                                   has yet to write, partly received messages (TCP) or
                                   granted destinations (RDMA) (4 MiB): more waits while
                                   it exceeds its share, recv_bytes_max / (other
                                   holders + 2), never below this; no other holder: any */
    uint32_t recv_min_rate;     /* bytes a second (1 MiB) a peer must deliver of that
                                   memory: over TCP measured over each recv_rate_ms
                                   while we read, over RDMA each grant written within
                                   recv_rate_ms + len / rate; else -ETIMEDOUT */
    uint32_t recv_rate_ms;      /* the window recv_min_rate is measured over (5000) */
    uint32_t streams_max;       /* sockets a peer may open on one connection (1024);
                                   further OPENs are refused (the peer's socket fails) */
    uint32_t setup_max;         /* accepted connections still in setup (64); a new one
                                   closes the oldest of them */
    uint32_t rndv_timeout_ms;   /* a rendezvous request of ours unanswered this long
                                   fails the engine with -ETIMEDOUT (30000) */
    uint32_t credit_timeout_ms; /* sends waiting this long for credits the peer does
                                   not return, and over RDMA a posted send not
                                   completed this long (RNR retried forever), fail
                                   the engine with -ETIMEDOUT (30000) */
    uint32_t transport;         /* BEX_TRANSPORT_* (AUTO); bex_sock_connect_opts can
                                   choose per connection */
    uint32_t io_threads;        /* I/O threads of the context (1, at most 64); each
                                   connection belongs to one, assigned round-robin */
    uint32_t poll_mode;         /* BEX_POLL_* (SPIN_SLEEP): how I/O threads wait */
    uint32_t srq_depth;         /* SRQ mode: receives of each I/O thread's shared receive
                                   queue, the pool from which every RDMA peer of the
                                   thread is granted rq_depth credits (0 = off: a receive
                                   queue per connection; else rq_depth..32768) */
    uint32_t srq_drain_ms;      /* SRQ mode: a failed connection's QP waits in the error
                                   state up to this long for the shared receive it may
                                   have taken to be flushed back before it is destroyed
                                   (500; docs/configuration.md) */
    /* RDMA provider options (docs/configuration.md, "RDMA options"). */
    uint32_t relaxed_ordering; /* BEX_SWITCH_* (AUTO = ON): register the context's own
                                  pools with IBV_ACCESS_RELAXED_ORDERING, an optional
                                  flag providers without it ignore; OFF: strict PCIe
                                  ordering. bex reads what a peer writes there only
                                  after the write's completion, which orders it */
    uint32_t traffic_class;    /* IP TOS byte (DSCP << 2 | ECN) of every RoCE v2 packet of
                                  the context's QPs (104: DSCP 26, the lossless class
                                  RoCE fabrics commonly reserve; ECN bits 0, the NIC's
                                  congestion control sets them); BEX_TRAFFIC_CLASS(v)
                                  for exactly v, 0 included */
    uint32_t service_level;    /* SL of the QPs' address vector, 0..7: the 802.1p priority
                                  on a VLAN (0); no effect on untagged RoCE v2 or rxe */
    uint32_t flow_label;       /* IPv6 flow label of the QPs' GRH, 0..0xfffff (0: the
                                  provider's own); some providers derive the RoCE v2 UDP
                                  source port (ECMP entropy) from it; no effect on rxe
                                  over IPv4 */
    uint32_t thread_domains;   /* BEX_SWITCH_* (AUTO): a thread domain per I/O thread
                                  for its QPs. AUTO: where the device has them; ON: a
                                  device without them fails bex_ctx_create with
                                  -EOPNOTSUPP (a failed allocation: its error); OFF:
                                  never. bex_sock_stats.thread_domains says what was
                                  chosen. Unverified on hardware (rxe has none) */
    uint64_t user_mem_max;     /* bytes of caller memory the context registers for
                                  zero-copy calls (bex_ps_rows_alloc) at once (1 GiB);
                                  past it such an allocation fails -ENOBUFS */
    /* The send window (docs/architecture.md, "Send window"; RDMA only).
     * STATIC: send_window as is. ADAPTIVE: each engine's window follows the
     * queueing delay it measures (time from posting a batch to its
     * completion, against the smallest seen), between send_window_min and
     * send_window_max, starting at send_window (16384 when 0). */
    uint32_t send_window_mode;          /* BEX_WINDOW_* (STATIC) */
    uint32_t send_window_min;           /* adaptive: smallest window, bytes (1024) */
    uint32_t send_window_max;           /* adaptive: largest window, bytes (262144) */
    uint32_t send_window_target_us;     /* adaptive: queueing delay above which the
                                           window is cut (1000) */
    uint32_t send_window_dest;          /* bytes in flight of all the engines sending to
                                           one remote IP address (ADAPTIVE: 262144,
                                           STATIC: none; UINT32_MAX: none); an engine
                                           with nothing in flight may always post one
                                           fragment */
    uint32_t send_window_base_max_us;   /* adaptive: the base delay's ceiling
                                           (none) */
    uint32_t send_window_base_epoch_ms; /* adaptive, with a base ceiling: the base is
                                           the smallest delay of the last one to two
                                           epochs of this length (2000), not of
                                           all time */
    uint32_t tcp_ack_delay_us;          /* TCP: how long the acknowledgements this side owes
                                           wait for a frame of ours to carry them before they
                                           go in one of their own (200; at most 1000000). A
                                           context that only makes requests (an RPC or PS
                                           client) can hold them until its next request on
                                           the connection: the server then reads no frame
                                           for them (docs/configuration.md) */
    uint32_t log_window_ms;             /* the log's rate window: each place in the library
                                           that logs passes at most 20 lines per window of
                                           this many ms and counts the rest (1000; at most
                                           3600000); a shorter one passes more lines */
} bex_ctx_config;

/* bex_ctx_config.send_window_mode */
enum {
    BEX_WINDOW_STATIC = 0,
    BEX_WINDOW_ADAPTIVE = 1,
};

/* Exactly v as bex_ctx_config.traffic_class, 0 included (a plain 0 means
 * the default). */
#define BEX_TRAFFIC_CLASS(v) (0x100u | ((uint32_t)(v)&0xffu))

/* Bounds of a shared secret, in bytes. */
#define BEX_SECRET_MIN 16
#define BEX_SECRET_MAX 4096

/* Read a key file into buf (cap bytes): its whole content, less one
 * trailing "\n" or "\r\n" (so `openssl rand -hex 32 > key` works as well as
 * 32 raw bytes). The file must be a regular file that neither group nor
 * others may read or write (mode 0600 or stricter, as ssh asks of its keys).
 * Returns 0 and sets *len, or -errno of open/read, -EPERM (group/other
 * access), -EINVAL (not a regular file, or fewer than BEX_SECRET_MIN bytes),
 * -EFBIG (more than cap or BEX_SECRET_MAX bytes). Any thread. */
int bex_secret_load(const char *path, void *buf, size_t cap, size_t *len);

/* Create a context: open the device that carries cfg->local_addr (with
 * BEX_TRANSPORT_TCP none; with AUTO, when none is usable, the context works
 * over TCP only and says so at INFO), take its PD, make the pools (cfg->pool
 * and cfg->landing_pool if given, else bemalloc pools of its own,
 * registered with the PD), and start cfg->io_threads I/O threads. The
 * environment's BEX_* settings (above) replace the fields they name first.
 * Returns 0, -EINVAL (a field out of range, local_addr the wildcard address, a
 * secret, or BEX_SECRET, of the wrong size, a BEX_* variable with a bad
 * value: an ERROR line names it), -ENODEV or -ENETDOWN (with
 * BEX_TRANSPORT_RDMA: no usable RDMA device has that address),
 * -EOPNOTSUPP (thread_domains ON on a device without thread domains, an
 * ERROR line says so; remote_access WINDOW on one without type-2 memory
 * windows), bex_secret_load's errors for
 * BEX_SECRET_FILE, or another negative errno;
 * on an error nothing is left behind. Any thread but a context's own I/O
 * thread. */
int bex_ctx_create(const bex_ctx_config *cfg, bex_ctx **out);

/* Stop the I/O thread and free everything. Every socket and listener of the
 * context must have been closed (and their on_close reported). Returns 0,
 * or -EDEADLK (nothing done) when called from a callback of this context. */
int bex_ctx_destroy(bex_ctx *ctx);

/* The context's bemalloc pool and PD. */
bex_mem_pool *bex_ctx_pool(bex_ctx *ctx);
/* The pool received buffers come from (eager receives and rendezvous
 * destinations; only the I/O thread allocates from it): its in-use bytes are
 * what the context holds of received data, bounded by recv_bytes_max. Its
 * buffers may be sent like those of bex_ctx_pool. */
bex_mem_pool *bex_ctx_recv_pool(bex_ctx *ctx);
/* The landing pool: rendezvous destinations and exposable buffers, the only
 * memory a peer may write (bex_sock_alloc_exposable). The rendezvous
 * destinations in it count toward recv_bytes_max. */
bex_mem_pool *bex_ctx_landing_pool(bex_ctx *ctx);
/* The mode the context runs in: BEX_REMOTE_ACCESS_LANDING or _WINDOW. */
int bex_ctx_remote_access(const bex_ctx *ctx);
struct ibv_pd *bex_ctx_pd(bex_ctx *ctx);

/* Allocate a buffer that can be passed to bex_sock_send (bex_mem_alloc on
 * the context's pool). NULL on failure. */
void *bex_sock_alloc(bex_ctx *ctx, size_t size);

/* Allocate a buffer that can be exposed with bex_sock_expose: memory of the
 * context's landing pool (see bex/mem.h), the only memory a peer may write.
 * It holds payload only: whatever a peer writes into the landing pool
 * cannot reach allocator state or any buffer of bex_sock_alloc. Free it
 * with bex_mem_free() (any thread); it may also be passed to
 * bex_sock_send. Usable size is a multiple of 4 KiB. NULL on failure. */
void *bex_sock_alloc_exposable(bex_ctx *ctx, size_t size);

/* Callbacks of a socket. All run on the I/O thread. Any may be NULL. */
typedef struct bex_sock_ops {
    /* connect finished: status 0, or -ECONNREFUSED / -ETIMEDOUT / ... (the
     * socket is then dead: close it with bex_sock_close()). Refusals:
     * -EACCES the secrets differ, or one side has a secret and the other
     * none; -EPROTO the peer's hello does not fit the connection (e.g. its
     * GID is not the TCP peer's address); -EBADMSG a malformed message. */
    void (*on_connect)(bex_sock *s, int status, void *user);
    /* a message arrived; buf (len bytes valid) now belongs to the
     * application: free it with bex_mem_free(). len may be 0 (buf non-NULL). */
    void (*on_recv)(bex_sock *s, void *buf, size_t len, void *user);
    /* a message given to bex_sock_send is done (status: see the top of this
     * file), or an exposed buffer comes back undelivered (-ECANCELED); buf
     * belongs to the caller again. When NULL, bex frees each such buffer
     * with bex_mem_free() instead (so pass buffers as bex_sock_alloc
     * returned them). */
    void (*on_send_done)(bex_sock *s, void *buf, size_t len, void *msg_user, int status,
                         void *user);
    /* the socket failed (engine error, keepalive timeout, peer closed):
     * every send the engine held has been handed back via on_send_done,
     * except those whose fragments the NIC still reads, which come back
     * when it is done (at once when the engine failed: its QP is gone),
     * and sends still in the hand-off queue, which come back right after
     * (-ECANCELED); exposed buffers have come back too. Not reported once
     * the socket is closed. Close the socket with bex_sock_close() (from
     * here too); on_close follows. */
    void (*on_error)(bex_sock *s, int err, void *user);
    /* after bex_sock_close(), once every message and exposed buffer is
     * reported and the peer has answered the close (or the connection
     * failed): the socket is gone; s is invalid after this returns. */
    void (*on_close)(bex_sock *s, void *user);
} bex_sock_ops;

/* Connect a socket to a listener at addr. Asynchronous: returns 0 and
 * reports the outcome through ops->on_connect; or returns an error at once
 * (then nothing is reported). If a connection to addr exists, the socket
 * joins it; otherwise one is made (TCP connect, hello, then the QP up, or
 * TCP on (bex_ctx_config.transport)). Sends may be issued before
 * on_connect; they wait. */
int bex_sock_connect(bex_ctx *ctx, const bex_addr *addr, const bex_sock_ops *ops, void *user,
                     bex_sock **out);

/* Per-connection choices for bex_sock_connect_opts; zero means the
 * context's. */
enum { BEX_CONNECT_TRANSPORT = 1u << 0 };
typedef struct bex_connect_opts {
    uint32_t flags;     /* BEX_CONNECT_*: which fields below apply */
    uint32_t transport; /* with BEX_CONNECT_TRANSPORT: BEX_TRANSPORT_* for this
                           connection (sockets join a connection to the same
                           address only if it has the same choice) */
} bex_connect_opts;

/* bex_sock_connect with per-connection options (opts may be NULL).
 * -ENODEV: RDMA only asked of a context without a device; -EINVAL: an
 * unknown flag or transport. */
int bex_sock_connect_opts(bex_ctx *ctx, const bex_addr *addr, const bex_sock_ops *ops, void *user,
                          const bex_connect_opts *opts, bex_sock **out);

/* Send len bytes at buf (from bex_sock_alloc/bex_mem_alloc of this context's
 * pool, bex_sock_alloc_exposable, or a buffer this context received; any pointer inside a live
 * allocation, as long as [buf, buf+len) stays inside it). Any other memory
 * (malloc's, the stack, another context's) is refused, not sent: -EINVAL,
 * with bex_last_error() naming the buffer; the same holds for every buffer
 * of bex_sock_send_req, bex_sock_sendv, bex_sock_send_direct and
 * bex_sock_expose. Returns 0
 * (on_send_done will report it) or at once -EINVAL (bad buffer or length),
 * -EPIPE (socket failed or closing; once failed, bex_sock_last_error says
 * why), -EMSGSIZE (len > 2 GiB - 1, or above the
 * peer's max_msg once the connection is up; a send queued before that and
 * found too large is handed back through on_send_done with -EMSGSIZE).
 * msg_user is handed back in on_send_done. */
int bex_sock_send(bex_sock *s, void *buf, size_t len, void *msg_user);

/* Storage for one send, provided by the caller (bex_sock_send_req): the
 * descriptor bex would otherwise allocate. Opaque; its size is fixed. */
typedef struct bex_send_req {
    void *priv[24];
} bex_send_req;

/* bex_sock_send with the caller's storage for the message's descriptor, so
 * that bex allocates nothing for it (libuv's uv_write_t habit). Same
 * arguments, returns and completion as bex_sock_send; req must not be NULL
 * (-EINVAL). On 0, req belongs to bex until on_send_done reports the
 * message (msg_user as given: it may point at the struct embedding req);
 * from the moment on_send_done is called, req is the caller's again, and
 * the callback may reuse it for the next send. On an error return bex never
 * took it. Each request carries one message at a time. */
int bex_sock_send_req(bex_sock *s, bex_send_req *req, void *buf, size_t len, void *msg_user);

/* A peer-writable buffer, for sends that skip the rendezvous. */
typedef struct bex_remote_buf {
    uint64_t addr;
    uint32_t rkey;
    uint32_t len;
    uint32_t token; /* names the buffer in the final WRITE_WITH_IMM */
} bex_remote_buf;

/* Expose buf (len bytes, from bex_sock_alloc_exposable of this context;
 * any other buffer is refused with -EINVAL) on socket s so that the peer
 * can write a message into it directly (bex_sock_send_direct). The
 * descriptor is for the application to pass to the peer (e.g. in an RPC).
 * The buffer belongs to bex until it is delivered through on_recv (with len
 * = the exposed length), or handed back through on_send_done (msg_user,
 * -ECANCELED) when it can no longer be delivered: the socket failed, or was
 * closed (then before on_close), or a write arrived after the application
 * closed it. Returns 0, -EINVAL, -ENOSPC (too many exposed buffers), -EPIPE
 * (the socket failed or is closing: the buffer was not taken),
 * -ENOTCONN. */
int bex_sock_expose(bex_sock *s, void *buf, uint32_t len, void *msg_user, bex_remote_buf *out);

/* Write len bytes at buf straight into the peer's exposed buffer rb: WRITE
 * fragments and a final WRITE_WITH_IMM, no rendezvous round trip. len must
 * equal rb->len. Completion as for bex_sock_send. */
int bex_sock_send_direct(bex_sock *s, void *buf, size_t len, const bex_remote_buf *rb,
                         void *msg_user);

/* Close the socket: queued sends are still sent (then on_send_done), also
 * when it is still connecting; the peer's socket is told (it gets on_error
 * -ECONNRESET and answers); then on_close is reported. Sends and exposes
 * after this return -EPIPE. Idempotent; any thread, callbacks included. */
void bex_sock_close(bex_sock *s);

/* The transport carrying s: BEX_TRANSPORT_RDMA or BEX_TRANSPORT_TCP once
 * its connection chose one (from on_connect on), 0 before or after it
 * failed. Only from a callback of s (its I/O thread). E.g. an exposed
 * buffer over TCP must be written whole (bex_sock_send_direct), over RDMA
 * a writer may fill less of it. */
int bex_sock_transport(const bex_sock *s);

/* The error that ended the socket (as on_error or on_connect reported it,
 * also when the application had closed it first) as one line of text into
 * buf (cap bytes, NUL-terminated, cut to fit): the peer's address, whether
 * it was still connecting, and bex_strerror's text, e.g. "peer
 * 10.0.0.2:7000: connecting: Connection refused". Returns that error (a
 * negative errno), or 0 and "no error" while the socket has not failed.
 * Any thread, until on_close returns. */
int bex_sock_last_error(const bex_sock *s, char *buf, size_t cap);

/* The user pointer last set (any thread). */
void *bex_sock_user(const bex_sock *s);
/* Replace the socket's callbacks (ops NULL: keep them) and user pointer.
 * From a callback on the socket's I/O thread (e.g. its on_accept) the
 * change is immediate. From another thread it is applied on the socket's
 * I/O thread in order with this thread's other calls (a later send's on_send_done sees it);
 * callbacks running meanwhile see the old pair, never a mix. Returns 0, or
 * -ENOMEM (nothing changed), -EINVAL. */
int bex_sock_set_user(bex_sock *s, const bex_sock_ops *ops, void *user);

/* Listener callbacks. on_accept hands over a new socket (opened by a peer's
 * bex_sock_connect); it sets the socket's ops with bex_sock_set_user() before
 * returning, and closes it with bex_sock_close() when done. Runs on the
 * accepted socket's I/O thread: with io_threads > 1, on_accept of one
 * listener may run on several threads at once. */
typedef struct bex_listener_ops {
    void (*on_accept)(bex_listener *l, bex_sock *s, void *user);
} bex_listener_ops;

/* Listen on addr (port 0 picks one; bex_listener_addr tells which). Any
 * thread, callbacks included. */
int bex_listen(bex_ctx *ctx, const bex_addr *addr, const bex_listener_ops *ops, void *user,
               bex_listener **out);
void bex_listener_addr(const bex_listener *l, bex_addr *out);
/* Stop listening (sockets already accepted are not affected; a connection
 * it accepted closes once its last socket is, so that a peer's next socket
 * to this address reaches whatever listens there next). Synchronous:
 * returns 0 once no on_accept runs or will run; -EDEADLK (nothing done) when
 * called from a callback of its context. */
int bex_listener_close(bex_listener *l);

/* Engine counters, for tests and benchmarks (approximate while running). */
typedef struct bex_sock_stats {
    uint64_t msgs_sent, msgs_recv;
    uint64_t bytes_sent, bytes_recv;
    uint64_t sends_posted;    /* SEND work requests */
    uint64_t writes_posted;   /* WRITE + WRITE_WITH_IMM work requests */
    uint64_t post_send_calls; /* ibv_post_send calls (doorbells) */
    uint64_t post_recv_calls;
    uint64_t signaled;           /* signaled work requests: at most one a doorbell, and
                                    a doorbell of inline SENDs alone goes unsignaled
                                    while fewer than sq_depth / 4 requests wait to be
                                    retired and no send window is set (RDMA: a
                                    ping-pong signals one in sq_depth / 4) */
    uint64_t credit_stalls;      /* times a send waited for peer credit */
    uint64_t window_stalls;      /* times a send waited for the send window */
    uint64_t max_inflight_bytes; /* highest bytes in flight seen on an engine (RDMA:
                                    posted and not yet retired by a signaled
                                    completion) */
    uint64_t credit_msgs;        /* explicit credit-update messages sent */
    uint64_t engines;            /* transports currently made: RDMA engines (from the
                                    start of their setup) and TCP connections */
    uint64_t recv_paused;        /* receives left unposted or rendezvous answers deferred
                                    (RDMA), or reading stopped (TCP), for the receive
                                    limits (recv_bytes_max, rndv_bytes_max): the peers
                                    were paced */
    uint64_t tcp_conns;          /* of engines: connections over the TCP transport. Over TCP
                                    the counters above count frames: a DIRECT frame as a
                                    WRITE, any other as a SEND, a sendmsg call as a
                                    doorbell */
    uint64_t srq_credits;        /* SRQ mode: credits the shared receive queues have
                                    granted to the peers now (their shares) */
    uint64_t srq_posted;         /* SRQ mode: receives posted on them now */
    uint64_t srq_refused;        /* SRQ mode: peers refused a share (queue full) */
    uint64_t rndv_prebound;      /* window mode: rendezvous answered with a destination
                                    whose window was bound ahead (no bind to wait for) */
    uint64_t srq_draining;       /* SRQ mode: QPs of gone connections waiting in the error
                                    state for their last receive (srq_drain_ms) */
    uint64_t thread_domains;     /* I/O threads whose QPs are on a thread domain of
                                    their own (0: the device has none, or
                                    bex_ctx_config.thread_domains is OFF) */

    uint64_t rnr_errors;      /* RDMA: connections failed with RNR retries exhausted (a peer
                                 that posts no receive for the credits it granted) */
    uint64_t retry_errors;    /* RDMA: connections failed with transport retries exhausted */
    uint64_t keepalive_fails; /* connections failed for the peer's silence (keepalive) */
    uint64_t tcp_fallbacks;   /* connections of transport AUTO that went over TCP (no device
                                 here or at the peer, or the QP could not come up) */
    /* The adaptive send window (send_window_mode ADAPTIVE; 0 otherwise) and
     * the per-destination bound (send_window_dest). */
    uint64_t window_bytes;      /* the engines' current windows, summed */
    uint64_t window_base_us;    /* smallest base delay an engine measured (0: none) */
    uint64_t window_delay_us;   /* the largest of the I/O threads' last delay samples */
    uint64_t window_cuts;       /* multiplicative decreases of a window */
    uint64_t dest_bound_hits;   /* times a send waited for its destination's bound */
    uint64_t dest_max_inflight; /* highest bytes in flight to one destination seen */
    uint64_t keepalive_writes;  /* RDMA: keepalive WRITEs posted (not in writes_posted;
                                   in post_send_calls and signaled: an idle engine's
                                   takes a doorbell of its own; also the one a tick
                                   posts to retire unsignaled requests once an engine
                                   went quiet) */
    uint64_t poll_recvs;        /* RDMA: receive completions the I/O threads polled */
    uint64_t poll_recv_conns;   /* RDMA: connections with a receive in a poll turn, once
                                   per turn: poll_recvs / this is how many of a QP's
                                   receives a turn takes together (its answers then
                                   leave in one ibv_post_send) */
    /* What the I/O threads' loops call per message (Figure 11's polls and
     * system calls; docs/benchmarks.md): */
    uint64_t cq_polls;        /* RDMA: ibv_poll_cq calls (the threads' CQs and SRQ mode's
                                 receive CQ; no system call: the CQ is mapped) */
    uint64_t cq_polls_empty;  /* of them, those that found no completion */
    uint64_t cq_arms;         /* RDMA: ibv_req_notify_cq calls (a system call each on rxe, a
                                 doorbell write on mlx5) */
    uint64_t cq_events;       /* RDMA: completion events read (ibv_get_cq_event: a read()) */
    uint64_t loop_waits;      /* epoll_wait calls of the I/O threads (a system call each) */
    uint64_t loop_sleeps;     /* of them, with a timeout other than 0: the thread slept */
    uint64_t loop_wake_reads; /* the I/O threads' reads of their wake-up eventfd (a
                                 system call each) */
    uint64_t loop_wakes;      /* other threads' writes to that eventfd, waking a sleeping
                                 I/O thread for a command (a system call each, theirs) */
    uint64_t empty_turns;     /* I/O threads' loop turns that found nothing to do (no
                                 completion, command, due timer or progress): what busy
                                 polling spins while it waits; bench/cost/run subtracts
                                 their cost from a busy run's instructions */
} bex_sock_stats;

void bex_ctx_stats(bex_ctx *ctx, bex_sock_stats *out);

/* The context's transport counters (bex_sock_stats: engines and TCP
 * connections now, messages and bytes, credit and window stalls, receive
 * pacing, RNR and retry errors, keepalive failures, fallbacks to TCP;
 * work requests, doorbells and lone credit updates; the I/O threads'
 * epoll_wait calls) and its pools' registered and in-use bytes (label
 * pool: "main", "recv", "landing"), in Prometheus text exposition format
 * (metric names bex_transport_*, bex_loop_* and bex_pool_*,
 * docs/configuration.md lists them),
 * NUL-terminated, into buf (cap bytes). Returns the length it needed
 * (without the NUL), like snprintf: the output is cut when that is >= cap;
 * -EINVAL. Any thread (approximate while the context runs). */
int bex_ctx_prometheus(bex_ctx *ctx, char *buf, size_t cap);

/* Buffers one bex_sock_sendv message gathers, at most. */
#define BEX_SOCK_IOV_MAX 4

/* Send one message gathered from iovcnt buffers (1..BEX_SOCK_IOV_MAX):
 * the peer receives one message, iov[0]'s bytes, then iov[1]'s, and so on,
 * exactly as if they had been sent from one buffer; no byte is copied.
 * Over TCP each fragment is cut at its buffer's end and the buffers go out
 * in one sendmsg (writev) with their frame headers. Over RDMA a message the
 * peer takes eagerly is one SEND whose scatter/gather list holds every
 * buffer (and the header, when the stream's id needs one), when the QP's
 * max_send_sge (the device's max_sge, up to BEX_SOCK_IOV_MAX + 1) holds
 * them all; otherwise, and for a large message, it goes by rendezvous, one
 * SGE a WRITE, each buffer's fragments in turn.
 * Each buffer obeys bex_sock_send's rules: memory this context registered
 * (bex_sock_alloc, bex_sock_alloc_exposable, a received buffer; any part
 * of one allocation) and not empty. iov itself is copied: the caller may
 * reuse it on return. Every buffer belongs to bex until on_send_done
 * reports the message once, with iov[0].iov_base as buf and the total
 * length as len (with on_send_done NULL, bex frees every buffer with
 * bex_mem_free). Returns 0 (on_send_done will report it), or at once:
 * -EINVAL (s or iov NULL, iovcnt 0, an empty buffer, one this context did
 * not register), -E2BIG (iovcnt > BEX_SOCK_IOV_MAX), -EPIPE (the socket
 * failed or is closing), -EMSGSIZE (a total past 2 GiB - 1 or the peer's
 * max_msg), -ENOMEM; then nothing was sent. Completion, order and
 * statuses as bex_sock_send. Any thread, callbacks included. */
int bex_sock_sendv(bex_sock *s, const struct iovec *iov, unsigned iovcnt, void *msg_user);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif
