"""Every Redis key Tollgate uses is named here, and only here.

All keys of one tenant carry the hash tag `{t<tenant>}`, so on a Redis Cluster they live in one
slot and one script call can touch every scope of a request. Layout:

    tg:{t<tenant>}:q:<scope>:<window>   counter hash {limit, used, pending, credit, over}
    tg:{t<tenant>}:q:<scope>:usd:<window>  spend counter hash (micro-dollars), same fields
    tg:{t<tenant>}:al:<scope>:<window>  allotment tier hash {taken, allot} of a project or key
                                        (lua/lib/tiers.lua): what it took in the window
    tg:{t<tenant>}:pool:<window>        the tenant's shared pool hash {taken, limit, credit}:
                                        what the scopes borrowed beyond their allotments
    tg:{t<tenant>}:hold:<request_id>    hold record hash {amount, created, keys, state, phase, ...}
    tg:{t<tenant>}:holds                zset of open holds, score = created ms (Redis clock)
    tg:{t<tenant>}:rate:<scope>:<period>ms  token bucket hash {tokens, ts} (request rate)
    tg:{t<tenant>}:conc:<scope>         zset of requests in flight (concurrency cap)
    tg:{t<tenant>}:usage                stream of usage events (one per ended hold)
    tg:{t<tenant>}:refused:<day window> hash {reason: count} of requests refused that UTC day
    tg:{t<tenant>}:epoch                string: present while the tenant's data is (see epoch_key)
    tg:{t<tenant>}:epoch:rebuilding     string: the lock of the process rebuilding the tenant
    tg:{t<tenant>}:pending-high         string: since when its pending holds are high (alerts)
    tg:{t<tenant>}:pace:trips           hash {scope: JSON} the latest burn-rate breaker trip of
                                        each scope (lua/pace_trip.lua, quotas/pace.py)
    tg:{t<tenant>}:waiters              zset of queue-policy waiters, score = expiry ms (its
                                        deadline, or a head's lease): an entry past it is dead
    tg:{t<tenant>}:waiters:in           hash waiter id -> the queue it waits in
    tg:{t<tenant>}:waiters:seq          string: arrival counter (order within a priority)
    tg:{t<tenant>}:wq:<resource>        zset of one resource's waiters, score = order (priority,
                                        then arrival); resource = q:<scope>[:usd]:<window kind>,
                                        rate:<scope>:<period>ms or conc:<scope>
    tg:{t<tenant>}:resp:<response id>   hash {pk, tokens} a stored Responses API response: the
                                        provider key holding it, its context size (expires)
    tg:{t<tenant>}:conv:<conversation>  hash {pk, tokens} a Responses API conversation, the same
    tg:answer-owner:<kind>:<id>         string: the tenant whose call made a stored response or
                                        conversation (a lookup across tenants, same expiry)
    tg:{p<provider key>}:cap            an upstream key's RPM / TPM buckets (supply side)
    tg:{p<provider key>}:waiters        zset of callers waiting for its capacity, score = expiry
    tg:{p<provider key>}:waiters:seq    string: their arrival counter
    tg:{p<provider key>}:wq             zset of those callers, score = order (plan priority,
                                        then arrival)
    tg:{p<provider key>}:brk            its circuit breaker for transport failures (hash)
    tg:{p<provider key>}:brk:m:<model>  its circuit breaker for one model's 5xx answers (hash)
    tg:{p<provider key>}:brk:models     set of the models with a breaker hash (admin, /metrics)
    tg:active:{a<shard>}                zset of the tenants with something for the background
                                        jobs to do (holds, undrained events, fresh usage), score
                                        = when last marked (ms, that shard's Redis clock), plus
                                        one `~<job>@<shards>` member per job: its last full walk
                                        (quotas/active.py); shard = crc32(tenant) % shards, each
                                        shard its own hash tag, so they spread over a cluster
    tg:ledger:backlog-alerted           string: operators were told about the ledger backlog
    tg:reconcile:lock:<date>            string: the lock of one day's reconciliation run
    tg:beat:<job>, tg:beat::schedule    the Celery beat's state (celery-redbeat): each job's
                                        definition and last run, the jobs by due time
    tg:beat::lock                       string: the active beat (host:pid:nonce; see
                                        beat_key_prefix)
    tg:auth:version                     string: count of invalidations published (gateway caches)
    tg:invalidate                       pub/sub channel: cached tenancy data changed
    tg:provider-cooldown                pub/sub channel: an upstream key cools down after a 429
    tg:queue-wake                       pub/sub channel: capacity freed where callers wait, or
                                        a waiter became the head of its queue
    tg:provider-breaker                 pub/sub channel: an upstream key's breaker changed state

Scopes: `tenant`, `project:<id>`, `key:<id>`, `model:<name>`.
Windows: `d2026-11-30` (day), `m2026-11` (month), `n2026-11-30T10:05` (minute),
`p600s2026-11-30T10:10:00` (a pace period of 600 s, UTC start; quotas/windows.py).
Which counters a request touches, with their limits, is defined in quotas/limits.py.
"""
from __future__ import annotations

import re
from datetime import date

_TENANT_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_SCOPE_RE = re.compile(r"^(tenant|project:[A-Za-z0-9_-]{1,64}|key:[A-Za-z0-9_-]{1,64}|model:[\x21-\x7e]{1,128})$")


def _tag(tenant: str) -> str:
    if not _TENANT_RE.match(tenant):
        raise ValueError(f"invalid tenant id for a Redis key: {tenant!r}")
    return f"tg:{{t{tenant}}}"


def tenant_tag(tenant_id: int) -> str:
    """The tenant id used in Redis key names (inside its hash tag): what every function here
    takes as `tenant`."""
    return str(tenant_id)


def validate_request_id(request_id: str) -> str:
    if not _REQUEST_ID_RE.match(request_id):
        raise ValueError(f"invalid request id: {request_id!r} (1-128 of A-Z a-z 0-9 _ . : -)")
    return request_id


def validate_scope(scope: str) -> str:
    if not _SCOPE_RE.match(scope):
        raise ValueError(f"invalid scope: {scope!r}")
    return scope


def counter_key(tenant: str, scope: str, window_id: str) -> str:
    return f"{_tag(tenant)}:q:{scope}:{window_id}"


def spend_counter_key(tenant: str, scope: str, window_id: str) -> str:
    """A spend counter (micro-dollars), beside the token counter of the same scope."""
    return counter_key(tenant, f"{scope}:usd", window_id)


def allotment_key(tenant: str, scope: str, window_id: str) -> str:
    """A project's or key's allotment tier in one window."""
    return f"{_tag(tenant)}:al:{scope}:{window_id}"


def pool_key(tenant: str, window_id: str) -> str:
    """The tenant's shared pool in one window (its quota minus the allotments)."""
    return f"{_tag(tenant)}:pool:{window_id}"


def hold_key(tenant: str, request_id: str) -> str:
    return f"{_tag(tenant)}:hold:{request_id}"


def hold_index_key(tenant: str) -> str:
    return f"{_tag(tenant)}:holds"


def tenant_scope() -> str:
    return "tenant"


def project_scope(project_id: object) -> str:
    return f"project:{project_id}"


def api_key_scope(key_id: object) -> str:
    return f"key:{key_id}"


def model_scope(model: str) -> str:
    return validate_scope(f"model:{model}")


def rate_key(tenant: str, scope: str, period_ms: int) -> str:
    return f"{_tag(tenant)}:rate:{scope}:{period_ms}ms"


def gauge_key(tenant: str, scope: str) -> str:
    return f"{_tag(tenant)}:conc:{scope}"


def usage_stream_key(tenant: str) -> str:
    return f"{_tag(tenant)}:usage"


def epoch_key(tenant: str) -> str:
    """The tenant's epoch marker. It lives in the tenant's slot, so a shard that lost its data
    loses the marker with the counters, and the reserve script (which checks it) notices."""
    return f"{_tag(tenant)}:epoch"


def rebuild_lock_key(tenant: str) -> str:
    """The lock of the process rebuilding the tenant's counters, beside its epoch marker."""
    return epoch_key(tenant) + ":rebuilding"


def usage_stream_pattern() -> str:
    """A SCAN pattern matching every tenant's usage stream (for when PostgreSQL cannot list
    the tenants)."""
    return usage_stream_key("0").replace("{t0}", "{t*}")


def pending_high_key(tenant: str) -> str:
    """When this tenant's pending was first seen above the alert level (unix seconds), with
    `:alerted` appended once operators were told (billing/alerts.py)."""
    return f"{_tag(tenant)}:pending-high"


def pace_trips_key(tenant: str) -> str:
    """The tenant's burn-rate breaker trips, one field per scope (quotas/pace.py)."""
    return f"{_tag(tenant)}:pace:trips"


def refused_key(tenant: str, day_window_id: str) -> str:
    """Requests the gateway refused on one UTC day, counted per reason (gateway/refusals.py)."""
    return f"{_tag(tenant)}:refused:{day_window_id}"


def queue_waiters_key(tenant: str) -> str:
    """The tenant's queue-policy waiters (every queue of the tenant), score = the entry's expiry
    on the Redis clock: whoever finds an entry past it drops it (a waiter whose process died).
    Its existence is what settle / release / sweep check before publishing a wake."""
    return f"{_tag(tenant)}:waiters"


def queue_member_key(tenant: str) -> str:
    """Which queue each of the tenant's waiters is in (waiter id -> queue key)."""
    return queue_waiters_key(tenant) + ":in"


def queue_seq_key(tenant: str) -> str:
    """The tenant's arrival counter: the order of waiters of one priority (no clocks)."""
    return queue_waiters_key(tenant) + ":seq"


def queue_key(tenant: str, resource: str) -> str:
    """The queue of one refusing resource of the tenant (see the resource names above): a queue
    per resource, so a project at its own limit holds up none of its tenant's other projects."""
    return f"{_tag(tenant)}:wq:{resource}"


def counter_resource(scope: str, window_kind: str, money: bool = False, role: str = "q") -> str:
    """A counter's queue resource: its scope and window kind, not the window itself, so waiters
    keep their places when a new window (a new counter key) begins. `role` "al" / "pool" names
    an allotment tier's or the pool's (never shared with the scope's own counter)."""
    if role != "q":
        return f"{role}:{scope}:{window_kind}"
    return f"q:{scope}:usd:{window_kind}" if money else f"q:{scope}:{window_kind}"


def rate_resource(scope: str, period_ms: int) -> str:
    return f"rate:{scope}:{period_ms}ms"


def gauge_resource(scope: str) -> str:
    return f"conc:{scope}"


# An upstream's id of a stored answer (resp_..., conv_...): what the parsers accept.
_ANSWER_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def _answer_id(answer_id: str) -> str:
    if not _ANSWER_ID_RE.match(answer_id):
        raise ValueError(f"invalid response or conversation id for a Redis key: {answer_id!r}")
    return answer_id


def response_key(tenant: str, response_id: str) -> str:
    """A stored Responses API response of the tenant (quotas/answers.py)."""
    return f"tg:{_tag(tenant)}:resp:{_answer_id(response_id)}"


def conversation_key(tenant: str, conversation_id: str) -> str:
    """A Responses API conversation of the tenant (quotas/answers.py)."""
    return f"tg:{_tag(tenant)}:conv:{_answer_id(conversation_id)}"


def answer_owner_key(kind: str, answer_id: str) -> str:
    """Which tenant made a stored response or conversation (`kind`: response, conversation):
    outside any tenant's slot, since the question is asked by another tenant."""
    if kind not in ("response", "conversation"):
        raise ValueError(f"invalid stored answer kind: {kind!r}")
    return f"tg:answer-owner:{kind}:{_answer_id(answer_id)}"


def provider_capacity_key(provider_key_id: int) -> str:
    """Capacity buckets of an upstream provider key: shared by tenants, so a tag of its own."""
    return f"tg:{{p{int(provider_key_id)}}}:cap"


def provider_breaker_key(provider_key_id: int) -> str:
    """The circuit breaker of an upstream provider key as a whole (transport failures), in the
    key's own slot beside its capacity buckets (gateway/circuit.py, lua/breaker_*.lua)."""
    return f"tg:{{p{int(provider_key_id)}}}:brk"


def provider_model_breaker_key(provider_key_id: int, model: str) -> str:
    """The circuit breaker of one model on an upstream provider key (5xx answers)."""
    return provider_breaker_key(provider_key_id) + ":m:" + validate_scope(f"model:{model}")[6:]


def provider_breaker_models_key(provider_key_id: int) -> str:
    """The set of models that have a breaker hash on this provider key (admin, /metrics)."""
    return provider_breaker_key(provider_key_id) + ":models"


def provider_waiters_key(provider_key_id: int) -> str:
    """Callers waiting for an upstream key's RPM / TPM capacity (every tenant's), score = the
    entry's expiry; in the key's own slot, beside its buckets."""
    return f"tg:{{p{int(provider_key_id)}}}:waiters"


def provider_seq_key(provider_key_id: int) -> str:
    return provider_waiters_key(provider_key_id) + ":seq"


def provider_queue_key(provider_key_id: int) -> str:
    """The upstream key's queue, score = order (the caller's plan priority, then arrival)."""
    return f"tg:{{p{int(provider_key_id)}}}:wq"


# -- the index of active tenants (quotas/active.py) -----------------------------------------------


def active_shard_key(shard: int) -> str:
    """One shard of the index of tenants the background jobs must visit. Each shard has its own
    hash tag, so on a cluster the shards spread over slots (and masters) instead of making one
    hot key; a tenant's scripts never touch it (they run in the tenant's slot)."""
    if shard < 0:
        raise ValueError(f"invalid shard of the active-tenant index: {shard}")
    return f"tg:active:{{a{int(shard)}}}"


# A shard member that is not a tenant: the time (score) of one job's last full walk. Tenant
# members are tenant tags ([A-Za-z0-9_-]), which never start with "~".
_WALK_PREFIX = "~"


def active_walk_member(job: str, shards: int) -> str:
    """The member of every shard whose score is `job`'s last full walk (quotas/active.py), for
    an index of `shards` shards: after a change of the count no shard has it, so every job walks
    every tenant once (a tenant may have moved to another shard)."""
    if not re.fullmatch(r"[a-z_]{1,32}", job):
        raise ValueError(f"invalid job name: {job!r}")
    return f"{_WALK_PREFIX}{job}@{int(shards)}"


def is_active_walk_member(member: str) -> bool:
    return member.startswith(_WALK_PREFIX)


# -- not a tenant's: no hash tag --------------------------------------------------------------------


def ledger_backlog_alert_key() -> str:
    """Set while operators have been told about the current ledger backlog episode (unix seconds
    of the alert); deleted when the backlog is young again (billing/alerts.py)."""
    return "tg:ledger:backlog-alerted"


def reconcile_lock_key(day: date) -> str:
    """The lock of one day's reconciliation run (billing/reconciliation.py)."""
    return f"tg:reconcile:lock:{day.isoformat()}"


def auth_version_key() -> str:
    """Incremented with every invalidation message, in the same script as the publish
    (quotas/invalidation.py): a gateway that sees it move without the message dropped a message
    and empties its auth cache (gateway/listener.py)."""
    return "tg:auth:version"


# -- pub/sub channels: names in Redis too, though not keys -----------------------------------------

# Cached tenancy data (keys, tenants, plans, the catalog, provider keys) changed: published by
# quotas/invalidation.py for tenants/invalidation.py, heard by every gateway (gateway/listener.py).
INVALIDATION_CHANNEL = "tg:invalidate"
# An upstream provider key answered 429: every gateway skips it until the time in the message.
PROVIDER_COOLDOWN_CHANNEL = "tg:provider-cooldown"
# Queue wakes (quotas/waiting.py): {"w": a waiters key} when capacity was freed where callers
# wait, {"w": ..., "ids": [...]} when these waiters became the heads of their queues.
QUEUE_WAKE_CHANNEL = "tg:queue-wake"
# An upstream provider key's circuit breaker opened, half-opened or closed (gateway/circuit.py):
# every gateway skips an open one at once.
PROVIDER_BREAKER_CHANNEL = "tg:provider-breaker"


def beat_key_prefix() -> str:
    """The Celery beat's keys (celery-redbeat, config/beat.py), on the broker's Redis by default
    (REDBEAT_REDIS_URL), never a cluster: `tg:beat:<job>` hash {definition, meta: last run},
    `tg:beat::schedule` zset of the jobs by due time, `tg:beat::statics` set of the jobs from
    the settings, `tg:beat::lock` string naming the active beat (host:pid:nonce), expiring
    TOLLGATE_BEAT_LOCK_TIMEOUT_SECONDS after its last tick."""
    return "tg:beat:"
