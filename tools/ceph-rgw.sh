#!/usr/bin/env bash
# A one-node Ceph cluster (mon, mgr, one memstore OSD) with a RADOS Gateway (S3, beast)
# on 127.0.0.1, for the tests of the remote tier. Everything lives under DIR.
#
#   tools/ceph-rgw.sh install            apt-get the Debian packages (idempotent)
#   tools/ceph-rgw.sh start DIR [PORT]   boot the cluster, create the S3 test user, wait for S3
#   tools/ceph-rgw.sh stop DIR           stop every daemon started under DIR (bounded)
#   tools/ceph-rgw.sh env DIR            print the AWS_* export lines for the gateway
#   tools/ceph-rgw.sh kill-rgw DIR       SIGKILL the gateway only (fault tests)
#   tools/ceph-rgw.sh start-rgw DIR      start the gateway again after kill-rgw, wait for S3
#
# Tunables (environment): CEPH_RGW_MEMSTORE_BYTES (default 1 GiB of RAM for the OSD),
# CEPH_RGW_START_TIMEOUT (seconds, default 90), CEPH_RGW_STOP_TIMEOUT (default 20).
# The data is in memory: stop loses it, which is what tests want.
set -euo pipefail

ACCESS_KEY=kvstoretest
SECRET_KEY=kvstoretestsecret
REGION=us-east-1
MEMSTORE_BYTES=${CEPH_RGW_MEMSTORE_BYTES:-1073741824}
START_TIMEOUT=${CEPH_RGW_START_TIMEOUT:-90}
STOP_TIMEOUT=${CEPH_RGW_STOP_TIMEOUT:-20}

die() { echo "ceph-rgw: $*" >&2; exit 1; }
ceph_() { timeout 30 ceph -c "$DIR/ceph.conf" "$@"; }

# poll CMD until it succeeds or DEADLINE (epoch seconds) passes
wait_until() {
    local deadline=$1 what=$2; shift 2
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] || die "timed out waiting for $what (logs: $DIR/log)"
        sleep 0.5
    done
}

s3_answers() { curl -s -m 2 -o /dev/null "http://127.0.0.1:$(cat "$DIR/port")/"; }

cmd_install() {
    local pkgs="ceph-mon ceph-osd ceph-mgr radosgw ceph-common curl"
    # shellcheck disable=SC2086
    if ! dpkg-query -W -f='${Status}\n' $pkgs 2>/dev/null | grep -c "install ok installed" \
            | grep -qx "$(echo $pkgs | wc -w)"; then
        apt-get update -q
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs
    fi
    ceph --version
}

start_rgw() {
    radosgw -n client.rgw -c "$DIR/ceph.conf"
    wait_until $(( $(date +%s) + START_TIMEOUT )) "S3 on port $(cat "$DIR/port")" s3_answers
}

cmd_start() {
    local port=${3:-7480}
    [ -e "$DIR/ceph.conf" ] && [ -n "$(pids)" ] && die "a cluster already runs under $DIR (stop it first)"
    command -v ceph-mon >/dev/null || die "Ceph is not installed: run $0 install"
    local t0 deadline
    t0=$(date +%s.%N); deadline=$(( $(date +%s) + START_TIMEOUT ))
    rm -rf "$DIR"; mkdir -p "$DIR"/{mon,osd0,mgr,run,log,rgw}
    echo "$port" > "$DIR/port"
    local fsid; fsid=$(cat /proc/sys/kernel/random/uuid)
    cat > "$DIR/ceph.conf" <<CONF
[global]
fsid = $fsid
mon host = 127.0.0.1:6789
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd objectstore = memstore
memstore device bytes = $MEMSTORE_BYTES
osd crush chooseleaf type = 0
# Pacific's OSD may send its start-up crush commands before it has the monmap (fsid
# 0000…, "wrong fsid", and the OSD exits): place it in the crush map ourselves
osd crush update on start = false
osd class update on start = false
osd op num shards = 1
osd op num threads per shard = 2
run dir = $DIR/run
log file = $DIR/log/\$name.log
admin socket = $DIR/run/\$name.asok
pid file = $DIR/\$name.pid
osd data = $DIR/osd\$id
mon data = $DIR/mon
mgr data = $DIR/mgr
ms bind ipv6 = false
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$port tcp_nodelay=1
rgw data = $DIR/rgw
rgw enable usage log = false
rgw thread pool size = 64
# reclaim deleted objects' tails within seconds, not hours: the data is in memory
rgw gc obj min wait = 0
rgw gc processor period = 5
rgw gc processor max time = 5
CONF
    ceph-mon --mkfs -i a --mon-data "$DIR/mon" --fsid "$fsid" -c "$DIR/ceph.conf" >/dev/null 2>&1
    ceph-mon -i a -c "$DIR/ceph.conf"
    ceph-mgr -i x -c "$DIR/ceph.conf"
    local uuid id; uuid=$(cat /proc/sys/kernel/random/uuid)
    id=$(ceph_ osd new "$uuid")
    ceph_ osd crush add "osd.$id" 1.0 root=default >/dev/null 2>&1
    ceph-osd -i "$id" --mkfs --osd-uuid "$uuid" -c "$DIR/ceph.conf" >/dev/null 2>&1
    ceph-osd -i "$id" -c "$DIR/ceph.conf" 2>>"$DIR/log/osd.stderr"
    radosgw -n client.rgw -c "$DIR/ceph.conf"
    wait_until "$deadline" "S3 on port $port" s3_answers
    timeout 30 radosgw-admin -c "$DIR/ceph.conf" user create --uid kvstoretest \
        --display-name "kvstore tests" --access-key "$ACCESS_KEY" --secret "$SECRET_KEY" >/dev/null
    local t1; t1=$(date +%s.%N)
    echo "Ceph $(ceph --version | awk '{print $3}') RGW on http://127.0.0.1:$port" \
         "(started in $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") s); $0 env $DIR prints the AWS_* exports"
}

pids() { cat "$DIR"/*.pid 2>/dev/null || true; }

cmd_stop() {
    local p left deadline=$(( $(date +%s) + STOP_TIMEOUT ))
    for p in $(pids); do kill "$p" 2>/dev/null || true; done
    while :; do
        left=""
        for p in $(pids); do kill -0 "$p" 2>/dev/null && left="$left $p"; done
        [ -z "$left" ] && break
        if [ "$(date +%s)" -ge "$deadline" ]; then
            for p in $left; do kill -9 "$p" 2>/dev/null || true; done
            sleep 0.5; break
        fi
        sleep 0.2
    done
    rm -f "$DIR"/*.pid
    echo "stopped the cluster under $DIR"
}

cmd_kill_rgw() {
    local p; p=$(cat "$DIR/client.rgw.pid")
    kill -9 "$p"
    while kill -0 "$p" 2>/dev/null; do sleep 0.1; done
    rm -f "$DIR/client.rgw.pid"
}

cmd_env() {
    [ -e "$DIR/port" ] || die "no cluster under $DIR (run $0 start $DIR)"
    echo "export AWS_ENDPOINT_URL=http://127.0.0.1:$(cat "$DIR/port")"
    echo "export AWS_ACCESS_KEY_ID=$ACCESS_KEY"
    echo "export AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
    echo "export AWS_REGION=$REGION"
}

sub=${1:-}
case "$sub" in
    install) cmd_install ;;
    start|stop|env|kill-rgw|start-rgw)
        DIR=$(realpath -m "${2:?usage: $0 $sub DIR}")
        case "$sub" in
            start) cmd_start "$@" ;;
            stop) cmd_stop ;;
            env) cmd_env ;;
            kill-rgw) cmd_kill_rgw ;;
            start-rgw) start_rgw ;;
        esac ;;
    *) sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
