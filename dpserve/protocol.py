"""Every message between dpserve processes, in one module.

Messages are msgspec Structs sent as msgpack (never pickle). A request from
a front-end to an engine is two frames: a one-byte `RequestType` tag, so
routing needs no decoding, then the msgpack body. Engines answer with
`EngineCoreOutputs`, which carry deltas (new tokens), not whole state.
In-process (the offline `LLM`) the same objects are passed directly.

Start-up handshake (engine <-> launcher, over the engine's DEALER socket):
    engine -> launcher: HandshakeHello
    launcher -> engine: EngineInitMetadata (where to connect)
    engine -> launcher: HandshakeReady (after the model and KV cache are up)
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from dpserve.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended (on the wire as its int value; `str()` is the OpenAI name)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class RequestType(bytes, enum.Enum):
    """First frame of every front-end -> engine message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    START_DP_WAVE = b"\x03"  # coordinator -> engines: join wave N
    REGROUP_DP = b"\x04"  # coordinator -> engines: the lockstep DP group is now this
    CONTROL = b"\x05"  # coordinator -> engines: be in this ControlState (pause / sleep)


# Sent by a dying engine on every output socket instead of EngineCoreOutputs,
# as two frames [ENGINE_CORE_DEAD, engine identity] so the front-end knows which.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


POOLING_TYPES = ("last", "mean")


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A pooling (embedding) request, vLLM's `PoolingParams`: the engine computes the
    prompt, samples nothing and finishes (reason stop) with its final hidden state
    (after the final norm) pooled over the prompt: the last token's ("last") or the
    mean of every position's ("mean"), in float32; `dimensions` keeps the first that
    many values, then `normalize` scales it to unit L2 norm. ValueError on construction
    (naming the field) for an unknown type or dimensions below 1."""

    pooling_type: str = "last"  # one of POOLING_TYPES
    normalize: bool = True
    dimensions: int | None = None  # None: the model's hidden size

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions!r}")


def engine_identity(rank: int) -> bytes:
    """The ZMQ identity of engine `rank`: its DP rank, 2 bytes little-endian."""
    return rank.to_bytes(2, "little")


class Session(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The conversation a request continues, for sticky routing (front-end only: the
    engine client routes by it and never sends it to an engine; `dpserve.frontend.
    routing`)."""

    key: str  # `x-session-id:...`, `response:<first id of the chain>` or `user:...`
    rank: int | None = None  # where its last turn ran, when known (the Responses store)


class RequestTags(msgspec.Struct, frozen=True, gc=False):
    """What an API request asks of the scheduling of its engine requests (front-end
    side; every EngineCoreRequest of it carries the same three fields)."""

    priority: int = 0  # vLLM's: lower runs first
    tenant: str | None = None  # whose share of the server it uses (None: nobody's)
    trace_headers: dict[str, str] | None = None  # W3C trace context (traceparent, ...)


NO_TAGS = RequestTags()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenised request, ready for the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    client_index: int = 0  # which front-end gets the outputs
    current_wave: int = 0  # the DP wave the front-end last saw
    data_parallel_rank: int | None = None  # pinned engine, if any
    # Migration: tokens another engine already generated for this request (they
    # count as outputs; outputs from here on carry only what comes after them).
    prior_output_token_ids: list[int] | None = None
    # Prefix-cache salt: folded into the hash of the first block (block_hash.root_hash),
    # so requests share cached blocks only with equal salts (None: unsalted).
    cache_salt: str | None = None
    # The LoRA adapter (its name, as registered with the engine's add_lora) this
    # request runs with; None: the base model. Unknown names fail add_request.
    lora_name: str | None = None
    # Front-end only: the session it belongs to (routing); None on the wire (`sendable`).
    session: Session | None = None
    # A pooling (embedding) request: no tokens are sampled, the output that finishes it
    # carries `EngineCoreOutput.pooled`. None: a generation request.
    pooling: PoolingParams | None = None
    # Prefill/decode disaggregation (vLLM's `do_remote_decode`): the first leg of a
    # handoff (max_tokens 1). Its engine makes the prompt's full blocks visible in the
    # host's KV tier before the output that finishes it leaves (tensor parallel:
    # commits the step's saves first), so the decode rank loads them.
    do_remote_decode: bool = False
    # Scheduling (RequestTags): the priority (lower runs first), the tenant whose share
    # it uses, and the W3C trace context of the API request it belongs to.
    priority: int = 0
    tenant: str | None = None
    trace_headers: dict[str, str] | None = None


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs for one new token of one request."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token_id, logprob), best first


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: a delta, not the whole state."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # prompt_logprobs: one entry per prompt token after the first (the logprobs of
    # token i+1 given tokens 0..i), sent once, with the request's first token.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # On the output that finishes a request (stop or length) in its engine: seconds
    # [queued (arrival -> first scheduled), prefill (-> first token), decode (-> finish)].
    phase_times: list[float] | None = None
    # The request failed for good, `finish_reason` is ABORT: set by a front-end's
    # engine client (no rank could take it over), or by an engine for a request it
    # could not start (its structured-output grammar failed or timed out).
    error: str | None = None
    # A pooling request's result, on the output that finishes it (reason stop): the
    # pooled vector as little-endian float32 bytes (PoolingParams says how it was made).
    pooled: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A snapshot of one engine's scheduler, for metrics and load reports."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    prefix_cache_queries: int  # tokens looked up in the prefix cache, cumulative
    prefix_cache_hits: int  # tokens found there, cumulative
    num_preemptions: int  # cumulative
    num_free_blocks: int
    wave: int = 0  # the engine's DP request wave (lockstep; set by the engine process)
    num_generated_tokens: int = 0  # output tokens sampled, cumulative
    # The host KV tier (--kv-offload-memory), cumulative; all 0 without one.
    kv_tier_queries: int = 0  # tokens asked of the tier (full blocks past local hits)
    kv_tier_hits: int = 0  # tokens loaded from it instead of computed
    kv_tier_loaded_bytes: int = 0  # bytes copied in (whole slots: every TP shard)
    kv_tier_saved_bytes: int = 0  # bytes copied out
    kv_tier_load_seconds: float = 0.0  # time spent in loads (worker 0's copies)
    # The host's store at its last answer: blocks it can hold (0: no tier, or the store
    # is down) and blocks it holds (routing sizes its record of the tier by the first).
    kv_tier_num_blocks: int = 0
    kv_tier_used_blocks: int = 0
    # Pooling (embedding) requests finished, and steps that finished at least one,
    # cumulative: requests batched into one step show as fewer steps than requests.
    num_pooled_requests: int = 0
    num_pooling_steps: int = 0
    # Waiting requests by priority, [[priority, count], ...] most urgent first; empty
    # (and off the wire) while every waiting request has priority 0 (engine.waiting_queue).
    waiting_by_priority: list[list[int]] = []
    # Speculative decoding (--speculative-config), cumulative: rows verified with drafts,
    # draft tokens verified, drafts accepted (vLLM's spec_decode_num_* metrics).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    """Call `EngineCore.<method>(*args)` in the engine; the answer is a UtilityOutput."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    failure_message: str | None = None  # set when the call raised; result is then None
    result: Any = None


class ControlState(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The pause / sleep state every rank should be in (an operator's last word).

    `seq` counts changes (the coordinator's, or one engine's without a
    coordinator); `token` is the front-end's tag of the change that made it."""

    seq: int = 0
    paused: str | None = None  # None | "abort" | "wait" | "keep"
    sleep_level: int = 0  # 0 awake; 1 KV cache freed; 2 weights too
    prefix_resets: int = 0  # reset_prefix_cache calls so far
    token: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message from an engine to one front-end."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    # No coordinator: the engine tells every front-end its ControlState when it
    # is applied (so each API server answers 503 while paused or asleep).
    control: ControlState | None = None


class HandshakeHello(msgspec.Struct, array_like=True, gc=False):
    local: bool  # the engine runs on the launcher's host


class EngineInitMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where an engine connects: one input and one output address per front-end."""

    input_addresses: list[str]
    output_addresses: list[str]
    # The DP coordinator, from the engine's side (None: no coordinator, dp_size 1):
    coordinator_input: str | None = None  # its engine XPUB; the engine SUBs (READY, waves)
    coordinator_output: str | None = None  # its report PULL; the engine PUSHes EngineReport
    dp_master_ip: str = "127.0.0.1"
    dp_master_port: int = 0
    dp_size: int = 1


class HandshakeReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    local: bool
    num_kv_blocks: int
    max_model_len: int


# ---- DP coordinator (dpserve.launch.coordinator) -------------------------------------
#
# Engine publish socket (coordinator XPUB -> engine SUB, each subscribed to b""):
#     first COORDINATOR_READY (one frame), once every engine has subscribed;
#     then [RequestType.START_DP_WAVE.value, StartDPWave] (two frames);
#     lockstep: [RequestType.REGROUP_DP.value, RegroupDP] at start-up and after
#     every membership change or failed collective.
#     COORDINATOR_READY again whenever an engine subscribes later (a restarted
#     engine waits for it; running engines ignore it). With LoRA on, READY has a
#     second frame, the adapter registry (msgpack name -> path): an engine loads
#     what it lacks before it serves.
# Engine report socket (engine PUSH -> coordinator PULL): EngineReport (load and
#     wave news from the busy loop; heartbeats from a thread, every second).
# Front publish socket (coordinator XPUB <-> front-end XSUB, subscribed to b""):
#     coordinator -> front-ends: CoordinatorUpdate;
#     front-ends and the launcher -> coordinator: a CoordinatorRequest
#     (WakeEngines | ScaleEngines | RankEvent | ScaleRequest | ScaleResult |
#     ControlChange | RankControl); launchers (their supervisors) read the updates
#     too, for `CoordinatorUpdate.restart`. API servers (several, cache-aware) also
#     send PrefixFacts, which the coordinator relays in a CoordinatorUpdate (its
#     `prefixes`) to every front-end, or drops when over its caps.
# Scaling at run time (dpserve.launch.scaler): a front-end's ScaleRequest ->
#     the coordinator publishes ScaleStatus PENDING (or REJECTED while another
#     runs) -> the launcher starts engines (ScaleEngines first: new ranks are
#     STARTING) or drains them (RankEvent DRAINING, then ScaleEngines) ->
#     ScaleResult -> the coordinator publishes DONE / FAILED.
# Control (pause / sleep): [RequestType.CONTROL.value, ControlState] on the engine
#     publish socket after every change (and after READY to a late engine); engines
#     answer EngineReport(control_done=seq) once in that state.

COORDINATOR_READY = b"READY"


class RankState(str, enum.Enum):
    """A DP rank as front-ends see it; only SERVING ranks get new work.

    starting -> serving -> (unhealthy | draining | dead) -> restarting -> serving;
    an unhealthy rank whose heartbeats and steps resume is serving again.
    """

    STARTING = "starting"  # spawned, not READY yet
    SERVING = "serving"
    UNHEALTHY = "unhealthy"  # no heartbeat, or work but no step, for too long
    DEAD = "dead"  # its process is gone (and stays gone unless restarted)
    RESTARTING = "restarting"  # its launcher is starting a new process for it
    DRAINING = "draining"  # finishes what it holds, takes nothing new


class RankStatus(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One rank's state; `incarnation` counts its processes (0 = the first)."""

    state: RankState = RankState.SERVING
    incarnation: int = 0
    reason: str = ""  # why it is not serving


class TPWorkerInfo(msgspec.Struct, array_like=True, gc=False):
    """One tensor-parallel worker of a DP rank (worker 0: the engine core's own
    process), as the engine's executor reports it (`worker_info()`)."""

    tp_rank: int
    pid: int
    device: str  # "cpu", or "cuda:<index>"
    rss_bytes: int  # resident memory of its process at the time of the report


class LoRAReport(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An engine's LoRA adapters (--enable-lora), in its heartbeat and in /engines."""

    resident: list[str] = []  # names in a device slot (a request runs at once)
    cached: list[str] = []  # names in host memory, not resident (a slot load away)
    registered: int = 0  # adapters this engine holds (any tier)
    adapters: dict[str, str] = {}  # name -> path of each (a restarted coordinator's seed)
    max_loras: int = 0  # its device slots
    loads: int = 0  # adapters put into a slot, cumulative
    evictions: int = 0  # adapters taken out of a slot for another, cumulative


class EngineReport(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> coordinator: load and wave news from one engine."""

    engine_index: int
    request_counts: list[int] | None = None  # [waiting, running] after `step` of `wave`
    step: int = 0  # the engine's step counter when the counts were taken
    wave: int = 0  # the engine's wave when the counts were taken
    wave_complete: int | None = None  # rank 0 only: all ranks paused after this wave
    start_wave: int | None = None  # got a request of a finished wave while paused
    # Heartbeats (a thread of the engine, every second): `step` is then the busy
    # loop's step count, `has_work` whether it holds unfinished requests.
    heartbeat: bool = False
    has_work: bool = False
    incarnation: int = 0  # which process of this rank (restarts count up)
    draining: bool = False  # heartbeat: it got SIGTERM and finishes what it holds
    # Lockstep: a collective (or joining) of this DP group generation failed here;
    # the engine waits, paused, for the coordinator to name the next generation.
    group_failed: int | None = None
    control_done: int | None = None  # this engine is in ControlState `seq` (applied)
    waiting_tokens: int = 0  # with request_counts: prompt tokens of the waiting requests
    # Heartbeat: what /engines shows (the coordinator publishes it as EngineInfo).
    kv_cache_usage: float = 0.0
    generated_tokens: int = 0  # output tokens sampled by this process, cumulative
    ttft_s: float = 0.0  # mean time to first token in this engine over the last 10 s
    pid: int | None = None
    host: str = ""
    tp_workers: list[TPWorkerInfo] = []  # heartbeat: the rank's TP workers (worker 0 first)
    lora: LoRAReport | None = None  # heartbeat: its LoRA adapters (None: LoRA off)
    kv_store_address: str = ""  # heartbeat: its host's KV store's tcp:// address ("": none)


class StartDPWave(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Coordinator -> engines: start running `wave` (body of START_DP_WAVE)."""

    wave: int
    exclude_engine_index: int | None = None  # this engine already runs it; skip it


class RegroupDP(msgspec.Struct, array_like=True, gc=False):
    """Coordinator -> engines (lockstep): form DP group `generation` of `members`
    (body of REGROUP_DP). Each generation has its own store prefix, so a stale
    collective never matches a new one; an engine not among `members` leaves its
    group and waits. Group rank = position in `members`; `members[0]` leads
    (reports wave completion)."""

    generation: int
    members: list[int]
    dp_size: int = 0  # the DP size now (ranks the coordinator's tables hold; 0: unknown).
    # Expert parallel: a rank re-shards its experts to (rank, dp_size) when this changed.


class EngineInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Coordinator -> front-ends: one rank as `GET /engines` shows it (besides its
    counts and state). `cordoned`: an operator took it out of placement (no new
    requests; what it holds goes on)."""

    cordoned: bool = False
    kv_cache_usage: float = 0.0  # fraction of KV blocks held, at its last heartbeat
    tokens_per_s: float = 0.0  # output tokens per second over the last few seconds
    wave: int = 0  # its request wave at its last load report
    pid: int | None = None
    host: str = ""
    ttft_s: float = 0.0  # mean time to first token in the engine over the last 10 s
    tp_workers: list[TPWorkerInfo] = []  # its tensor-parallel workers, at its last heartbeat
    lora: LoRAReport | None = None  # its LoRA adapters, at its last heartbeat
    # Its host's KV store's tcp:// address, where other hosts' stores pull from and a
    # front-end asks for pulls (a server over several hosts; "": none).
    kv_store_address: str = ""


class RestartRank(msgspec.Struct, array_like=True, gc=False):
    """Coordinator -> launchers: restart `rank`'s process `incarnation` (an operator
    asked; the launcher that runs it does it, the others ignore it)."""

    rank: int
    incarnation: int


# The most block hashes one PrefixFacts carries (2048 of 32 bytes: about 66 KB).
MAX_PREFIX_FACTS = 2048


class PrefixFacts(msgspec.Struct, tag="prefixes", array_like=True, gc=False):
    """API server -> coordinator -> every API server (`--load-balance cache-aware` with
    several API servers): the prompt blocks one API server's router placed lately, so
    the others' routers record them too (`dpserve.frontend.prefix_record`). The
    coordinator relays it as `CoordinatorUpdate.prefixes`, or drops it when it is over
    its caps (`MAX_PREFIX_FACTS` hashes: `dpserve.launch.coordinator.prefix_relay`)."""

    client_index: int  # the sender (its own relayed facts are skipped)
    ranks: list[int]  # [n] one rank per run of blocks
    blocks: list[list[bytes]]  # [n] block hashes placed on ranks[i], least recent first


class CoordinatorUpdate(msgspec.Struct, array_like=True, gc=False):
    """Coordinator -> front-ends: engine load and the global wave state."""

    counts: list[list[int]] | None  # [num_engines][waiting, running]; None: wave news only
    wave: int  # the current request wave
    running: bool  # engines are running (False: paused, a new request must wake them)
    ranks: list[RankStatus] | None = None  # [num_engines]; None: no state news
    control: ControlState | None = None  # pause / sleep state (None: no news)
    control_done: list[int] | None = None  # [num_engines] the ControlState seq each applied
    waiting_tokens: list[int] | None = None  # [num_engines] with counts: waiting prompt tokens
    engines: list[EngineInfo] | None = None  # [num_engines]; None: no news
    restart: RestartRank | None = None  # for the launchers (supervisors) only
    scale: ScaleStatus | None = None  # the latest change of the engine count (or answer)
    autoscale_decisions: list[int] | None = None  # [up, down] the autoscaler made, in total
    # The DP-wide LoRA adapter registry, name -> path (None: LoRA off); in every publish.
    loras: dict[str, str] | None = None
    prefixes: PrefixFacts | None = None  # another API server's placements (relayed)


class WakeEngines(msgspec.Struct, tag="wake", array_like=True, gc=False):
    """Front-end -> coordinator: I sent a request while the engines were paused."""

    wave: int  # the wave the front-end stamped on the request
    engine_index: int | None = None  # the engine that got the request (skipped)


class ScaleEngines(msgspec.Struct, tag="scale", array_like=True, gc=False):
    """Launcher/front-end -> coordinator: the number of DP engines is now `num_engines`."""

    num_engines: int


class ScaleRequest(msgspec.Struct, tag="scale_request", array_like=True, gc=False):
    """Front-end -> coordinator: change the number of DP engines to `num_engines`
    (answered by a `ScaleStatus` with the same `scale_id` in a `CoordinatorUpdate`)."""

    scale_id: str
    num_engines: int


class ScalePhase(str, enum.Enum):
    PENDING = "pending"  # accepted by the coordinator; its launcher carries it out
    DONE = "done"
    FAILED = "failed"  # the launcher could not do it (the engine count is `old_size`)
    REJECTED = "rejected"  # another change was running (nothing done)
    REFUSED = "refused"  # the placement cannot hold the new size (`message`: what is missing)


class ScaleStatus(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Coordinator -> front-ends and the launcher: where change `scale_id` stands."""

    scale_id: str
    phase: ScalePhase
    old_size: int
    new_size: int
    message: str = ""  # why it failed or was rejected; the autoscaler's reason


class ScaleResult(msgspec.Struct, tag="scale_result", array_like=True, gc=False):
    """Launcher -> coordinator: change `scale_id` is done (`ok`) or failed (`message`);
    `refused`: nothing was started, the placement cannot hold the new size."""

    scale_id: str
    ok: bool
    message: str = ""
    refused: bool = False


class RankEvent(msgspec.Struct, tag="rank", array_like=True, gc=False):
    """Launcher -> coordinator: what it knows first hand of one of its engines
    (the process died, is being restarted, or is READY again)."""

    rank: int
    status: RankStatus


class ControlChange(msgspec.Struct, tag="control", array_like=True, gc=False):
    """Front-end -> coordinator: pause / resume / sleep / wake_up / reset_prefix_cache
    on every rank (`arg`: the pause mode or sleep level; `token`: the sender's tag)."""

    op: str
    arg: str | int | None = None
    token: int = 0


class RankControl(msgspec.Struct, tag="rank_control", array_like=True, gc=False):
    """API server -> coordinator: an operator's `POST /engines/{rank}/{action}`;
    action "cordon" | "uncordon" (published in `EngineInfo.cordoned`) or "restart"
    (published as `CoordinatorUpdate.restart` for the rank's launcher)."""

    rank: int
    action: str


class LoRAChange(msgspec.Struct, tag="lora", array_like=True, gc=False):
    """API server -> coordinator: adapter `name` is now loaded on every live rank from
    `path` (op "add"), or is being unloaded (op "remove"): the registry changes and is
    published (`CoordinatorUpdate.loras`); ranks that start later load it before READY."""

    op: str
    name: str
    path: str = ""


CoordinatorRequest = (WakeEngines | ScaleEngines | RankEvent | ScaleRequest | ScaleResult
                      | ControlChange | RankControl | LoRAChange)


# ---- rendezvous (external / hybrid load balancing) ------------------------------
#
# The head (rank 0's host) answers on tcp://<data-parallel-address>:<rpc port>
# (its ROUTER; other hosts' launchers connect a DEALER): where the coordinator is.


class RendezvousRequest(msgspec.Struct, array_like=True, gc=False):
    """A host's launcher -> the head: I run ranks [start_rank, start_rank + size_local)."""

    start_rank: int
    size_local: int


class RendezvousReply(msgspec.Struct, array_like=True, gc=False):
    """The head -> a host's launcher: the coordinator's tcp addresses and the DP store."""

    coordinator_input: str  # its engine XPUB (engines SUB)
    coordinator_output: str  # its report PULL (engines PUSH)
    coordinator_front: str  # its front XPUB (API servers XSUB)
    dp_master_ip: str
    dp_master_port: int
