#!/bin/sh
# One Redis server of a run that fails over (compose/compose.sentinel.yaml,
# docs/transports.md): the compose file and the failover tests start every
# server with this script, so both run the same flags.
#
# It asks the Sentinels which server is the primary and starts as its replica,
# or as the primary where they name this server. A server whose data is gone
# (a lost host or volume) never starts as the primary while the Sentinels
# still name it and know a replica of it: that replica holds the run, and a
# replica syncs from its primary, so an empty primary would empty it. It
# waits for the Sentinels to promote the replica, then replicates from it.
#
# Environment:
#   DDILOCO_REDIS_NODE     this server's HOST:PORT, as the others reach it
#   DDILOCO_REDIS_PRIMARY  HOST:PORT of the primary a new run starts with
#   DDILOCO_SENTINELS      HOST:PORT,HOST:PORT,... of the Sentinels
#   DDILOCO_REDIS_FILES    redis.acl, redis.crt, redis.key, tls.ca.crt and
#                          redis.sentinel of the run's key folder
#   DDILOCO_REDIS_DATA     its data folder (append-only file)
# Arguments: more redis-server options (maxmemory, bind, logfile).
set -eu
node=$DDILOCO_REDIS_NODE
files=$DDILOCO_REDIS_FILES
data=$DDILOCO_REDIS_DATA
service=ddiloco
password=$(cat "$files/redis.sentinel")

# SENTINEL "$@" as the servers' user, from the first Sentinel that answers.
ask_sentinels() {
    for sentinel in $(echo "$DDILOCO_SENTINELS" | tr ',' ' '); do
        if out=$(redis-cli --tls --cacert "$files/tls.ca.crt" -h "${sentinel%:*}" \
            -p "${sentinel##*:}" --user ddiloco-sentinel --pass "$password" \
            --no-auth-warning --raw SENTINEL "$@" 2>/dev/null); then
            case "$out" in ERR* | NOAUTH* | NOPERM* | "") ;; *) echo "$out"; return 0 ;; esac
        fi
    done
    return 1
}

primary_now() {
    ask_sentinels get-master-addr-by-name "$service" | paste -sd: -
}

primary=$(primary_now || true)
case "$primary" in *:[0-9]*) ;; *) primary=$DDILOCO_REDIS_PRIMARY ;; esac
if [ "$primary" = "$node" ] && [ ! -d "$data/appendonlydir" ] \
    && ask_sentinels replicas "$service" | grep -qx name; then
    echo "redis-node: no data here, and the Sentinels know a replica: waiting for its promotion" >&2
    while [ "$primary" = "$node" ]; do
        sleep 1
        primary=$(primary_now || echo "$node")
    done
fi

# The servers' password stays off the command line (ps shows that).
install -m 600 /dev/null "$data/replication.conf"
printf 'masteruser ddiloco-sentinel\nmasterauth %s\n' "$password" >"$data/replication.conf"
if [ "$primary" = "$node" ]; then
    role=""
    echo "redis-node: starting as the primary" >&2
else
    role="--replicaof ${primary%:*} ${primary##*:}"
    echo "redis-node: starting as a replica of $primary" >&2
fi
# A write is taken only while a replica is at most 10 s behind (else
# NOREPLICAS, retried by every client): a primary cut off from the others
# stops taking what a failover would throw away. Replicas sync at once
# (no diskless delay), over TLS, as the servers' user.
# shellcheck disable=SC2086  # $role is two words or none
exec redis-server "$data/replication.conf" \
    --port 0 --tls-port "${node##*:}" \
    --tls-cert-file "$files/redis.crt" --tls-key-file "$files/redis.key" \
    --tls-ca-cert-file "$files/tls.ca.crt" --tls-auth-clients no --tls-replication yes \
    --aclfile "$files/redis.acl" \
    --dir "$data" --appendonly yes --appendfsync always \
    --replica-announce-ip "${node%:*}" \
    --min-replicas-to-write 1 --min-replicas-max-lag 10 \
    --repl-diskless-sync-delay 0 \
    $role "$@"
