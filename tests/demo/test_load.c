/* SPDX-License-Identifier: Apache-2.0 */
/* tools/demo/load.c's pieces that need no server: the open loop's
 * Poisson arrivals (bex-ranker --rate, bench/cost/fetch-sweep). */
#include <math.h>

#include "harness.h"
#include "load.h"

/* Arrivals at rate R come R a second on average, at any rate: over 1 s of
 * the timeline, a Poisson count of mean R (standard deviation sqrt(R)),
 * checked at rates whose mean gap is 5 us to 10 ms. At 200 000/s the
 * count is 200 000 +- 447: 1 % off is 4.5 deviations. Gaps rounded to
 * whole microseconds would give 221 000 (a mean gap of 4.52 us, not 5). */
static int poisson_rate(void)
{
    static const double rates[] = {100, 5000, 50000, 200000};
    for (size_t i = 0; i < sizeof rates / sizeof rates[0]; i++) {
        double r = rates[i];
        uint64_t rng = 12345 + i;
        struct ld_poisson p = {.rate = r, .t_us = 1000000};
        uint64_t n = 0, last = p.t_us;
        for (uint64_t t; (t = ld_poisson_advance(&p, &rng)) < 2000000; n++) {
            CHECK(t >= last); /* on one timeline, never back */
            last = t;
        }
        double dev = fabs((double)n - r) / sqrt(r);
        fprintf(stderr, "rate %.0f: %llu arrivals in 1 s (%.1f deviations)\n", r,
                (unsigned long long)n, dev);
        CHECK(dev < 4.5);
    }
    return 0;
}

/* Quantiles of few values keep their order: with two, the P50 is not
 * above the P99 (bex-ranker's issue_lag_us gave p50 442, p99 8 with two
 * samples, the P50 taken at n / 2). */
static int quantiles(void)
{
    static const uint32_t v[] = {3, 8, 442, 1000, 5000};
    for (size_t n = 1; n <= 5; n++) {
        uint32_t p50 = ld_quantile(v, n, 0.5), p99 = ld_quantile(v, n, 0.99);
        uint32_t max = ld_quantile(v, n, 1);
        CHECK(v[0] <= p50 && p50 <= p99 && p99 <= max);
        CHECK_EQ(max, v[n - 1]);
    }
    CHECK_EQ(ld_quantile(v, 2, 0.5), 3);
    CHECK_EQ(ld_quantile(v, 5, 0.5), 442);
    CHECK_EQ(ld_quantile(v, 0, 0.5), 0);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(poisson_rate), BEX_CASE(quantiles))
