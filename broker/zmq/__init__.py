"""ZeroMQ backend: brokerless, learner DEALER/SUB <-> syncer ROUTER/PUB.

Each syncer binds a ROUTER for deltas, heartbeats and snapshot requests, and
a PUB beside it for globals; a learner connects one DEALER and one SUB to
every syncer shard, and fragment ``p`` belongs to shard
``owner_shard(p, syncer_shards)`` (:func:`broker.fragments.owner_shard`).

Why these sockets: PUSH would block at its high-water mark and PUB silently
drops, so deltas go DEALER -> ROUTER with an explicit ack, resent until
acknowledged; globals are full fragment weights (or a change from the version
before), so PUB's drops are harmless as long as they are noticed, and a gap
becomes a snapshot request over the DEALER.

The modules, one job each:

* :mod:`broker.zmq.options`: the options a URL sets;
* :mod:`broker.zmq.frames`: socket making, framing, bounded receive, decode;
* :mod:`broker.zmq.addressing`: where each shard is, and a learner's sockets
  dialled (and re-dialled) there;
* :mod:`broker.zmq.delivery`: at-least-once delivery of deltas;
* :mod:`broker.zmq.snapshots`: candidate globals, and gap to snapshot request;
* :mod:`broker.zmq.leases`: learner slots, the learner's and the syncer's side;
* :mod:`broker.zmq.curve`: CURVE keys, enrollment and key rotation, both sides;
* :mod:`broker.zmq.auth`: the ZAP handler, who may connect;
* :mod:`broker.zmq.inbound`: a learner's inbound messages, each to its part;
* :mod:`broker.zmq.learner`: :class:`~broker.zmq.learner.ZmqLearnerTransport`;
* :mod:`broker.zmq.syncer`: :class:`~broker.zmq.syncer.ZmqSyncerTransport`.
"""
