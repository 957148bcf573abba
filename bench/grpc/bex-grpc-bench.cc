/* SPDX-License-Identifier: Apache-2.0 */
/* bex-grpc-bench: echo RPC latency and rate over gRPC C++ (issue 9 item 10,
 * the yardstick bex-rpc-bench is compared with; bench/rpc/compare runs both).
 *
 *   server: bex-grpc-bench -s --local ADDR [-p PORT]
 *   client: bex-grpc-bench -c SERVER --local ADDR [-p PORT]
 *                          [--size B] [--outstanding K] [--iters N] [--warmup W] [--json]
 *                          [--stdin]
 *   matrix: bex-grpc-bench --matrix [--iters N] [--warmup W] [--json]
 *           forks a server on BEX_TEST_ADDR0 (default 127.0.0.1) and runs
 *           the client on BEX_TEST_ADDR1 (127.0.0.2) for 64 B, 4 KiB and
 *           64 KiB bodies with 1 and 64 calls outstanding.
 *   --stdin: one cell per line of standard input, "SIZE OUTSTANDING ITERS
 *           WARMUP", each with a connection of its own, until end of file
 *           (as bex-rpc-bench's --stdin, for bench/rpc/compare).
 *   (--transport tcp is accepted, so that a runner can pass both benches
 *   the same options; gRPC has no other transport here.)
 *
 * It measures what bex-rpc-bench measures, the same way: one connection
 * (one channel) per cell, a first empty call outside the measurement, then
 * K calls outstanding, each completion sending the next call with the
 * response's bytes as the next request; latency per call from the call's
 * start to its completion; P50, P99, mean and calls/s over --iters calls
 * after --warmup; a deadline of 10 s per call and no retries. Both sides
 * use gRPC's asynchronous API with one completion-queue thread each (the
 * client's main thread, the server's main thread), as bex has one I/O
 * thread per context; gRPC's own internal threads come with it. The proto
 * is bench/grpc/echo.proto: Echo(Body) -> Body with one bytes field.
 *
 * The client makes its TCP connection itself (bound to --local, then handed
 * to gRPC with CreateInsecureChannelFromFd): gRPC cannot pick a source
 * address, and in the Soft-RoCE VM only traffic from 10.99.0.2 to 10.99.0.1
 * crosses the veth wire (scripts/rxe-vm); from any other source the kernel
 * would take the loopback. TCP_NODELAY is set on it, as gRPC does on the
 * sockets it makes.
 *
 * With --json each result is one JSON object on one line, with the keys of
 * bex-rpc-bench's ("bench":"grpc", "transport":"tcp"). Exit status 1 when
 * a call failed (a non-OK status or a response of the wrong length). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/create_channel_posix.h>
#include <grpcpp/grpcpp.h>

#include "echo.grpc.pb.h"

namespace
{

constexpr uint16_t default_port = 18522;
constexpr auto call_deadline = std::chrono::seconds(10);
/* requests the server keeps posted, so that 64 calls outstanding never wait
 * for the server to ask for the next one */
constexpr int server_posted = 128;

struct Opts {
    bool server = false, matrix = false, json = false, from_stdin = false;
    const char *client = nullptr;
    struct in_addr local = {};
    bool have_local = false;
    uint16_t port = default_port;
    size_t size = 64;
    uint32_t outstanding = 1;
    uint64_t iters = 10000, warmup = 1000;
};

uint64_t now_ns()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

[[noreturn]] void die(const char *what, const std::string &why)
{
    fprintf(stderr, "bex-grpc-bench: %s: %s\n", what, why.c_str());
    exit(1);
}

std::string addr_str(struct in_addr a)
{
    char b[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a, b, sizeof b);
    return b;
}

/* ---------------- server ---------------- */

volatile sig_atomic_t stop_flag;
void on_signal(int)
{
    stop_flag = 1;
}

/* One posted request: first its arrival (answered at once with its own
 * bytes), then the end of its answer (freed). */
struct ServerCall {
    explicit ServerCall(bexbench::Echo::AsyncService *svc, grpc::ServerCompletionQueue *cq)
        : responder(&ctx)
    {
        svc->RequestEcho(&ctx, &req, &responder, cq, cq, this);
    }
    grpc::ServerContext ctx;
    bexbench::Body req, resp;
    grpc::ServerAsyncResponseWriter<bexbench::Body> responder;
    bool answered = false;
};

void serve_loop(bexbench::Echo::AsyncService *svc, grpc::ServerCompletionQueue *cq)
{
    void *tag;
    bool ok;
    while (cq->Next(&tag, &ok)) {
        auto *c = static_cast<ServerCall *>(tag);
        if (!ok || c->answered) {
            /* answered, or a posted request cancelled by Shutdown */
            delete c;
            continue;
        }
        new ServerCall(svc, cq);
        c->resp.mutable_data()->swap(*c->req.mutable_data());
        c->answered = true;
        c->responder.Finish(c->resp, grpc::Status::OK, c);
    }
}

/* Serve until SIGINT/SIGTERM (ready_fd < 0) or until quit_fd's peer closes
 * (matrix: the port goes to ready_fd first). */
int run_server(const Opts &o, int ready_fd, int quit_fd)
{
    bexbench::Echo::AsyncService svc;
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort(addr_str(o.local) + ":" + std::to_string(o.port),
                       grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&svc);
    std::unique_ptr<grpc::ServerCompletionQueue> cq = b.AddCompletionQueue();
    std::unique_ptr<grpc::Server> server = b.BuildAndStart();
    if (!server || port == 0)
        die("listen", addr_str(o.local) + ":" + std::to_string(o.port) + " refused");
    for (int i = 0; i < server_posted; i++)
        new ServerCall(&svc, cq.get());
    /* the main thread answers; another one waits for the end */
    std::thread waiter([&] {
        if (ready_fd >= 0) {
            uint16_t p = htons((uint16_t)port);
            if (write(ready_fd, &p, sizeof p) != sizeof p)
                die("ready pipe", strerror(errno));
            char q;
            ssize_t r = read(quit_fd, &q, 1);
            (void)r;
        } else {
            while (!stop_flag)
                usleep(100 * 1000);
        }
        server->Shutdown();
        cq->Shutdown();
    });
    if (ready_fd < 0) {
        fprintf(stderr, "bex-grpc-bench: serving on %s:%d (grpc %s)\n", addr_str(o.local).c_str(),
                port, grpc::Version().c_str());
        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);
    }
    serve_loop(&svc, cq.get());
    waiter.join();
    return 0;
}

/* ---------------- client ---------------- */

struct Run;

/* One of the K calls outstanding. A ClientContext serves one call only:
 * each call gets a fresh one. */
struct Slot {
    Run *r = nullptr;
    uint64_t t0 = 0;
    std::unique_ptr<grpc::ClientContext> ctx;
    bexbench::Body req, resp;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<bexbench::Body>> call;
};

struct Run {
    bexbench::Echo::Stub *stub;
    grpc::CompletionQueue cq;
    size_t size;
    uint64_t total, warmup; /* calls to complete: warmup + iters */
    uint64_t issued = 0, completed = 0, errors = 0;
    std::vector<uint64_t> lat_ns; /* per measured call */
    uint64_t t_first = 0, t_last = 0;
};

void issue(Slot *s)
{
    Run *r = s->r;
    if (r->issued++ >= r->total)
        return;
    s->ctx = std::make_unique<grpc::ClientContext>();
    s->ctx->set_deadline(std::chrono::system_clock::now() + call_deadline);
    s->resp.Clear();
    s->t0 = now_ns();
    s->call = r->stub->AsyncEcho(s->ctx.get(), s->req, &r->cq);
    s->call->Finish(&s->resp, &s->status, s);
}

/* A TCP connection from local to srv, ready for gRPC. */
int connect_from(struct in_addr local, const struct sockaddr_in &srv)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket", strerror(errno));
    struct sockaddr_in la = {};
    la.sin_family = AF_INET;
    la.sin_addr = local;
    int one = 1;
    if (bind(fd, (const struct sockaddr *)&la, sizeof la))
        die("bind", addr_str(local) + ": " + strerror(errno));
    if (connect(fd, (const struct sockaddr *)&srv, sizeof srv))
        die("connect", addr_str(srv.sin_addr) + ":" + std::to_string(ntohs(srv.sin_port)) + ": " +
                           strerror(errno));
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) ||
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK))
        die("socket options", strerror(errno));
    return fd;
}

int run_client(const Opts &o, const struct sockaddr_in &srv)
{
    int fd = connect_from(o.local, srv);
    std::string target = addr_str(srv.sin_addr) + ":" + std::to_string(ntohs(srv.sin_port));
    std::shared_ptr<grpc::Channel> ch = grpc::CreateInsecureChannelFromFd(target, fd);
    std::unique_ptr<bexbench::Echo::Stub> stub = bexbench::Echo::NewStub(ch);
    /* the connection first, outside the measurement */
    {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + call_deadline);
        bexbench::Body req, resp;
        grpc::Status st = stub->Echo(&ctx, req, &resp);
        if (!st.ok())
            die("first call", st.error_message());
    }
    Run r;
    r.stub = stub.get();
    r.size = o.size;
    r.total = o.warmup + o.iters;
    r.warmup = o.warmup;
    r.lat_ns.resize(o.iters);
    std::vector<Slot> slots(o.outstanding);
    uint64_t t_start = now_ns();
    for (uint32_t i = 0; i < o.outstanding; i++) {
        slots[i].r = &r;
        slots[i].req.set_data(std::string(o.size, (char)i));
        issue(&slots[i]);
    }
    unsigned reported = 0;
    while (r.completed < r.total) {
        void *tag;
        bool ok;
        if (!r.cq.Next(&tag, &ok))
            die("completion queue", "shut down");
        uint64_t t = now_ns();
        auto *s = static_cast<Slot *>(tag);
        uint64_t n = r.completed++;
        bool good = ok && s->status.ok() && s->resp.data().size() == r.size;
        if (!good) {
            r.errors++;
            if (reported++ < 10)
                fprintf(stderr, "bex-grpc-bench: call failed: %s\n",
                        !s->status.ok() ? s->status.error_message().c_str()
                                        : "response of the wrong length");
        }
        if (n >= r.warmup)
            r.lat_ns[n - r.warmup] = t - s->t0;
        if (n + 1 == r.warmup)
            r.t_first = t;
        if (n + 1 == r.total) {
            r.t_last = t;
            break;
        }
        /* the answer's bytes are the next request, as bex-rpc-bench sends
         * the response body back */
        s->req.mutable_data()->swap(*s->resp.mutable_data());
        if (!good)
            s->req.set_data(std::string(r.size, 'x'));
        issue(s);
    }
    /* every call issued has completed (issued stops at total) */
    r.cq.Shutdown();
    void *tag;
    bool ok;
    while (r.cq.Next(&tag, &ok)) {
    }
    if (!o.warmup)
        r.t_first = t_start;
    std::sort(r.lat_ns.begin(), r.lat_ns.end());
    double sum = 0;
    for (uint64_t v : r.lat_ns)
        sum += (double)v;
    uint64_t n = o.iters;
    double p50 = (double)r.lat_ns[(n - 1) / 2] / 1000.0;
    double p99 = (double)r.lat_ns[(n * 99 - 1) / 100] / 1000.0;
    double mean = sum / (double)n / 1000.0;
    double secs = (double)(r.t_last - r.t_first) / 1e9;
    double rate = secs > 0 ? (double)n / secs : 0;
    if (o.json)
        printf("{\"bench\":\"grpc\",\"transport\":\"tcp\",\"size\":%zu,\"outstanding\":%u,"
               "\"iters\":%llu,\"p50_us\":%.2f,\"p99_us\":%.2f,\"mean_us\":%.2f,"
               "\"calls_per_s\":%.0f,\"errors\":%llu}\n",
               o.size, o.outstanding, (unsigned long long)n, p50, p99, mean, rate,
               (unsigned long long)r.errors);
    else
        printf("grpc  %8zu B %3u out: P50 %9.2f us  P99 %9.2f us  mean %9.2f us  %10.0f calls/s"
               "  errors %llu\n",
               o.size, o.outstanding, p50, p99, mean, rate, (unsigned long long)r.errors);
    fflush(stdout);
    return r.errors ? 1 : 0;
}

int run_matrix(Opts &o)
{
    const char *s0 = getenv("BEX_TEST_ADDR0"), *s1 = getenv("BEX_TEST_ADDR1");
    struct in_addr a0, a1;
    if (inet_pton(AF_INET, s0 ? s0 : "127.0.0.1", &a0) != 1 ||
        inet_pton(AF_INET, s1 ? s1 : "127.0.0.2", &a1) != 1)
        die("BEX_TEST_ADDR0/1", "not IPv4 addresses");
    int up[2], down[2];
    if (pipe(up) || pipe(down))
        die("pipe", strerror(errno));
    /* fork before either side touches gRPC */
    fflush(nullptr);
    pid_t pid = fork();
    if (pid < 0)
        die("fork", strerror(errno));
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        Opts so = o;
        so.local = a0;
        so.port = 0;
        exit(run_server(so, up[1], down[0]));
    }
    close(up[1]);
    close(down[0]);
    uint16_t port;
    if (read(up[0], &port, sizeof port) != sizeof port)
        die("server", "did not start");
    struct sockaddr_in srv = {};
    srv.sin_family = AF_INET;
    srv.sin_port = port;
    srv.sin_addr = a0;
    static const size_t sizes[] = {64, 4096, 65536};
    static const uint32_t outs[] = {1, 64};
    int rc = 0;
    o.local = a1;
    for (size_t sz : sizes)
        for (uint32_t k : outs) {
            o.size = sz;
            o.outstanding = k;
            rc |= run_client(o, srv);
        }
    close(down[1]);
    int status;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status))
        rc = 1;
    return rc;
}

[[noreturn]] void usage(int status = 2)
{
    fprintf(status ? stderr : stdout,
            "usage: bex-grpc-bench -s --local ADDR [-p PORT]\n"
            "       bex-grpc-bench -c SERVER --local ADDR [-p PORT] [--size B]\n"
            "                      [--outstanding K] [--iters N] [--warmup W] [--json]"
            " [--stdin]\n"
            "       bex-grpc-bench --matrix [--iters N] [--warmup W] [--json]\n"
            "       bex-grpc-bench --help | --version\n");
    exit(status);
}

} // namespace

int main(int argc, char **argv)
{
    Opts o;
    static const struct option lo[] = {{"server", no_argument, nullptr, 's'},
                                       {"client", required_argument, nullptr, 'c'},
                                       {"local", required_argument, nullptr, 'l'},
                                       {"port", required_argument, nullptr, 'p'},
                                       {"transport", required_argument, nullptr, 't'},
                                       {"size", required_argument, nullptr, 'S'},
                                       {"outstanding", required_argument, nullptr, 'o'},
                                       {"iters", required_argument, nullptr, 'n'},
                                       {"warmup", required_argument, nullptr, 'w'},
                                       {"json", no_argument, nullptr, 'j'},
                                       {"matrix", no_argument, nullptr, 'm'},
                                       {"stdin", no_argument, nullptr, 'I'},
                                       {"help", no_argument, nullptr, 'h'},
                                       {"version", no_argument, nullptr, 'V'},
                                       {nullptr, 0, nullptr, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "sc:l:p:", lo, nullptr)) != -1) {
        switch (ch) {
        case 's':
            o.server = true;
            break;
        case 'c':
            o.client = optarg;
            break;
        case 'l':
            if (inet_pton(AF_INET, optarg, &o.local) != 1)
                usage();
            o.have_local = true;
            break;
        case 'p':
            o.port = (uint16_t)atoi(optarg);
            break;
        case 't':
            if (strcmp(optarg, "tcp"))
                usage();
            break;
        case 'S':
            o.size = (size_t)strtoull(optarg, nullptr, 0);
            break;
        case 'o':
            o.outstanding = (uint32_t)atoi(optarg);
            break;
        case 'n':
            o.iters = strtoull(optarg, nullptr, 0);
            break;
        case 'w':
            o.warmup = strtoull(optarg, nullptr, 0);
            break;
        case 'j':
            o.json = true;
            break;
        case 'm':
            o.matrix = true;
            break;
        case 'I':
            o.from_stdin = true;
            break;
        case 'h':
            usage(0);
        case 'V':
            printf("bex-grpc-bench %s\n", BEX_GRPC_BENCH_VERSION);
            return 0;
        default:
            usage();
        }
    }
    if (optind != argc || o.outstanding < 1 || o.iters < 1)
        usage();
    if (o.matrix)
        return run_matrix(o);
    if (!o.have_local || o.server == !!o.client)
        usage();
    if (o.server)
        return run_server(o, -1, -1);
    struct sockaddr_in srv = {};
    srv.sin_family = AF_INET;
    srv.sin_port = htons(o.port);
    if (inet_pton(AF_INET, o.client, &srv.sin_addr) != 1)
        usage();
    if (!o.from_stdin)
        return run_client(o, srv);
    /* one cell per line; a malformed line ends the run with status 2 */
    int rc = 0;
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long sz, k, n, w;
        if (sscanf(line, "%llu %llu %llu %llu", &sz, &k, &n, &w) != 4 || k < 1 || n < 1 ||
            k > UINT32_MAX) {
            fprintf(stderr, "bex-grpc-bench: --stdin: bad line: %s", line);
            return 2;
        }
        o.size = (size_t)sz;
        o.outstanding = (uint32_t)k;
        o.iters = n;
        o.warmup = w;
        rc |= run_client(o, srv);
    }
    return rc;
}
