"""The KV host tier: one store per host whose shared-memory arena every local DP rank maps.

    layout.py    `TierLayout`: what one slot holds (a KV block: all layers, K and V,
                 every TP shard), fixed by the store's first client
    arena.py     the shared-memory segment: created and unlinked by the store,
                 `attach_arena` maps it in engines and TP workers
    store.py     `TierIndex`: hash -> slot, LRU, slot states, read pins, per-client
                 ownership (pure logic)
    messages.py  the store's wire messages (msgspec)
    server.py    the `dpserve::KVStore` process: a ZMQ ROUTER over a `TierIndex` (and,
                 for a server over several hosts, a tcp:// one for other hosts' pulls)
    client.py    `KVTierClient`: an engine's bounded, never-raising client
    transfer.py  blocks between two hosts' stores: the destination's `PullJob`, the
                 source's `answer_fetch` (chunked, a bounded window in flight)
    pull.py      `pull`: a front-end's async call asking one store to pull from another

Not here: starting and supervising the store (`dpserve.launch.kv_store`), the
engine's connector (`dpserve.engine`), the copies (`dpserve.model.runner`).
"""
