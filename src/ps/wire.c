/* SPDX-License-Identifier: Apache-2.0 */
/* The PS wire format's strict decoder (docs/protocol.md, "Parameter
 * server"): a peer's body is checked whole before anything is applied. */
#include <errno.h>

#include "ps/ps_internal.h"

size_t bex__ps_req_len(uint32_t method, uint32_t n, uint32_t dim)
{
    size_t len = BEX__PS_HDR_LEN + 8 * (size_t)n;
    if (method == BEX_PS_M_PUSH)
        len += 4 * (size_t)n * dim;
    return len;
}

static int hdr_get(const void *body, size_t len, struct bex__ps_hdr *h)
{
    const uint8_t *p = body;
    if (!body || len < BEX__PS_HDR_LEN)
        return -EINVAL;
    if (p[0] != BEX__PS_VERSION || p[1] || (p[2] & ~(BEX__PS_F_ID | BEX__PS_F_EPOCH)) || p[3])
        return -EINVAL;
    h->flags = p[2];
    h->id_client = h->id_seq = h->id_tok[0] = h->id_tok[1] = h->epoch = 0;
    h->table = bex__ps_hdr_get32(p + 4);
    h->n = bex__ps_hdr_get32(p + 8);
    h->dim = bex__ps_hdr_get32(p + 12);
    if (h->dim == 0)
        return -EINVAL;
    if (h->n > BEX_PS_KEYS_MAX || h->dim > BEX_PS_DIM_MAX || len > BEX_PS_BODY_MAX)
        return -E2BIG;
    return 0;
}

int bex__ps_decode(uint32_t method, const void *body, size_t len, struct bex__ps_hdr *h)
{
    int rc = hdr_get(body, len, h);
    if (rc)
        return rc;
    /* n and dim are bounded above: the products fit in size_t */
    size_t want = bex__ps_req_len(method, h->n, h->dim);
    if (h->flags & BEX__PS_F_ID) {
        /* only a Push carries an id */
        if (method != BEX_PS_M_PUSH || len < BEX__PS_HDR_LEN + BEX__PS_ID_LEN)
            return -EINVAL;
        const uint8_t *p = (const uint8_t *)body + BEX__PS_HDR_LEN;
        h->id_client = bex__ps_get64(p);
        h->id_seq = bex__ps_get64(p + 8);
        h->id_tok[0] = bex__ps_get64(p + 16);
        h->id_tok[1] = bex__ps_get64(p + 24);
        want += BEX__PS_ID_LEN;
    }
    if (h->flags & BEX__PS_F_EPOCH) {
        /* only after an id */
        if (!(h->flags & BEX__PS_F_ID) ||
            len < BEX__PS_HDR_LEN + BEX__PS_ID_LEN + BEX__PS_EPOCH_LEN)
            return -EINVAL;
        h->epoch = bex__ps_get64((const uint8_t *)body + BEX__PS_HDR_LEN + BEX__PS_ID_LEN);
        want += BEX__PS_EPOCH_LEN;
    }
    size_t answer = BEX__PS_HDR_LEN + 4 * (size_t)h->n * h->dim; /* a Fetch's rows */
    if (want > BEX_PS_BODY_MAX || (method == BEX_PS_M_FETCH && answer > BEX_PS_BODY_MAX))
        return -E2BIG;
    return len == want ? 0 : -EINVAL;
}

int bex__ps_check_resp(uint32_t method, const void *body, size_t len, uint32_t table, uint32_t n,
                       uint32_t dim)
{
    struct bex__ps_hdr h;
    if (hdr_get(body, len, &h) || (h.flags & ~BEX__PS_F_EPOCH) ||
        (h.flags && method != BEX_PS_M_PUSH) || h.table != table || h.n != n || h.dim != dim)
        return -EBADMSG;
    size_t want = BEX__PS_HDR_LEN + (h.flags ? BEX__PS_EPOCH_LEN : 0);
    if (method == BEX_PS_M_FETCH)
        want += 4 * (size_t)n * dim;
    return len == want ? 0 : -EBADMSG;
}
