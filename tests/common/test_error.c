/* SPDX-License-Identifier: Apache-2.0 */
/* bex_strerror: errno text, and bex's own meaning of the codes it gives
 * one (issue 27 item 8; docs/protocol.md). */
#include <string.h>

#include "harness.h"
#include "bex/common.h"

static int strerror_texts(void)
{
    CHECK(strcmp(bex_strerror(0), "success") == 0);
    CHECK(strstr(bex_strerror(-ENOMEM), "memory") != NULL);
    /* positive and negative codes name the same error */
    CHECK(strcmp(bex_strerror(ETIMEDOUT), bex_strerror(-ETIMEDOUT)) == 0);
    CHECK(bex_strerror(-99999) != NULL);
    return 0;
}

/* A code with a meaning in bex says it after the system's text. */
static int bex_codes(void)
{
    static const struct {
        int err;
        const char *says;
    } want[] = {
        {EIO, "in doubt"},           {ECANCELED, "not sent"},      {ESTALE, "retry horizon"},
        {EAGAIN, "nothing applied"}, {EBUSY, "asked for a retry"}, {EPROTO, "protocol"},
        {EBADMSG, "malformed"},      {EACCES, "authentication"},   {ETIMEDOUT, "deadline"},
        {ENOSPC, "max_rows"},        {ENODEV, "RDMA device"},      {EMSGSIZE, "max_msg"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const char *t = bex_strerror(-want[i].err);
        const char *sys = strerrordesc_np(want[i].err);
        CHECK(t && sys);
        if (!strstr(t, want[i].says) || strncmp(t, sys, strlen(sys)) != 0)
            fprintf(stderr, "%d: \"%s\"\n", want[i].err, t);
        CHECK(strstr(t, want[i].says) != NULL);
        CHECK(strncmp(t, sys, strlen(sys)) == 0);
        CHECK(strstr(t, "(bex: ") != NULL);
    }
    /* others: the system's text alone */
    CHECK(strcmp(bex_strerror(-ENOMEM), strerrordesc_np(ENOMEM)) == 0);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(strerror_texts), BEX_CASE(bex_codes))
