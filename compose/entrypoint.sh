#!/bin/sh
# The image's entrypoint: run the command as the user ddiloco, never as root.
#
# Started as root (the default), it first makes the top of each folder under
# /ddiloco writable for ddiloco: a folder bind-mounted from the host is owned by
# whoever created it there. Then it replaces itself with the command, so the
# service is the container's main process (a SIGKILL of it is a crash of the
# service) and gets docker's signals itself. Started as another user
# (`user:` in the compose file), it runs the command as that user unchanged.
set -e
# The run's keys, from the service's secrets (docker compose bind-mounts them
# with the host's owner and mode, a swarm as root): copied where only ddiloco
# reads them, the folder DDILOCO_KEYS names.
keys=/home/ddiloco/keys
if [ "$(id -u)" = 0 ] && [ -d /run/secrets ]; then
    install -d -m 700 -o ddiloco -g ddiloco "$keys"
    for name in join.secret syncer.curve.pub signing.pub tls.ca.crt syncer.curve signing.key redis.syncer; do
        if [ -f "/run/secrets/$name" ]; then
            install -m 600 -o ddiloco -g ddiloco "/run/secrets/$name" "$keys/$name"
        fi
    done
fi
if [ "$(id -u)" = 0 ]; then
    for dir in /ddiloco/*/; do
        if ! setpriv --reuid=ddiloco --regid=ddiloco --init-groups test -w "$dir"; then
            chown ddiloco:ddiloco "$dir"
        fi
    done
    export HOME=/home/ddiloco USER=ddiloco
    exec setpriv --reuid=ddiloco --regid=ddiloco --init-groups -- "$@"
fi
exec "$@"
