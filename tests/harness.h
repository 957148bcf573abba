/* SPDX-License-Identifier: Apache-2.0 */
/* A minimal test harness. A test program lists its cases with BEX_TEST_MAIN;
 * CTest runs each case as its own test (argv[1] = case name).
 *
 * Exit codes: 0 pass, 1 fail, 77 skip (CTest SKIP_RETURN_CODE). A case that
 * finds no RDMA device returns bex_test_skip(why): that skips, unless
 * BEX_REQUIRE_RDMA=1, when it fails. */
#ifndef BEX_TEST_HARNESS_H
#define BEX_TEST_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BEX_TEST_SKIP 77

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_EQ(a, b)                                                                             \
    do {                                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                                        \
        if (a_ != b_) {                                                                            \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s (%lld) != %s (%lld)\n", __FILE__,          \
                    __LINE__, #a, a_, #b, b_);                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Expect a bex call to return 0; print bex_strerror otherwise. */
#define CHECK_OK(expr)                                                                             \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ != 0) {                                                                            \
            fprintf(stderr, "%s:%d: %s returned %d (%s)\n", __FILE__, __LINE__, #expr, rc_,        \
                    strerror(rc_ < 0 ? -rc_ : rc_));                                               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Sanitizer builds run several times slower (and slower still in the
 * emulated VM): tests/CMakeLists.txt gives every test BEX_TEST_TIME_SCALE
 * (1 plain, 3 ASan, 10 TSan) and stretches CTest's timeouts by it. Every
 * liveness deadline of a test (a wait, a watchdog, a reaping deadline) is
 * written unscaled and multiplied by this at the one place that waits. */
static inline unsigned bex_test_time_scale(void)
{
    const char *s = getenv("BEX_TEST_TIME_SCALE");
    int v = s ? atoi(s) : 1;
    return v >= 1 ? (unsigned)v : 1;
}

/* Milliseconds of the monotonic clock. */
static inline uint64_t bex_test_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static inline void bex_test_sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

struct bex_test_case {
    const char *name;
    int (*fn)(void); /* returns 0, or BEX_TEST_SKIP */
};

/* Skip (or, with BEX_REQUIRE_RDMA=1, fail) with a reason. */
static inline int bex_test_skip(const char *why)
{
    const char *req = getenv("BEX_REQUIRE_RDMA");
    if (req && strcmp(req, "0") != 0 && req[0]) {
        fprintf(stderr, "FAIL: %s, and BEX_REQUIRE_RDMA is set\n", why);
        exit(1);
    }
    fprintf(stderr, "SKIP: %s\n", why);
    return BEX_TEST_SKIP;
}

static inline int bex_test_run(const struct bex_test_case *cases, size_t n, int argc, char **argv)
{
    int ran = 0;
    for (size_t i = 0; i < n; i++) {
        if (argc > 1 && strcmp(argv[1], cases[i].name) != 0)
            continue;
        ran++;
        fprintf(stderr, "== %s\n", cases[i].name);
        int rc = cases[i].fn();
        if (rc == BEX_TEST_SKIP)
            return argc > 1 ? BEX_TEST_SKIP : 1;
        if (rc != 0) {
            fprintf(stderr, "FAIL: %s (%d)\n", cases[i].name, rc);
            return 1;
        }
    }
    if (!ran) {
        fprintf(stderr, "no such case: %s\n", argc > 1 ? argv[1] : "(none)");
        return 1;
    }
    return 0;
}

#define BEX_TEST_MAIN(...)                                                                         \
    int main(int argc, char **argv)                                                                \
    {                                                                                              \
        static const struct bex_test_case cases_[] = {__VA_ARGS__};                                \
        return bex_test_run(cases_, sizeof cases_ / sizeof cases_[0], argc, argv);                 \
    }
#define BEX_CASE(fn)                                                                               \
    {                                                                                              \
#fn, fn                                                                                    \
    }

#endif
