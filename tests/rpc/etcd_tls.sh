#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# etcd over TLS for test_dir_etcd_tls: a throwaway CA, a server certificate
# for localhost/127.0.0.1 and a client certificate, all under DIR, then
# exec etcd on https://127.0.0.1:CPORT requiring client certificates.
#   etcd_tls.sh DIR CPORT PPORT
set -e
d=$1 cport=$2 pport=$3
cd "$d"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
key ca.key
openssl req -x509 -new -key ca.key -subj /CN=bex-test-ca -days 1 -out ca.crt
# no CommonName in the server's certificate: with --client-cert-auth etcd's
# JSON gateway dials etcd with it, and with authentication on a CN there
# fails every request ("CommonName of client sending a request against
# gateway will be ignored")
for who in server client; do
    key $who.key
    openssl req -new -key $who.key -subj /O=bex-test-$who -out $who.csr
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' >$who.ext
    openssl x509 -req -in $who.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
        -extfile $who.ext -out $who.crt 2>/dev/null
done
url=https://127.0.0.1:$cport peer=http://127.0.0.1:$pport
exec "${BEX_ETCD:-etcd}" --name t --data-dir "$d/data" --listen-client-urls "$url" \
    --advertise-client-urls "$url" --listen-peer-urls "$peer" \
    --initial-advertise-peer-urls "$peer" --initial-cluster "t=$peer" \
    --cert-file "$d/server.crt" --key-file "$d/server.key" --client-cert-auth \
    --trusted-ca-file "$d/ca.crt" --auth-token simple --auth-token-ttl 1 --log-level warn \
    >"$d/log" 2>&1
