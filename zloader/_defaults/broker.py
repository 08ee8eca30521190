"""The broker's tunables: heartbeats, floods and exhaustion, autoscaling and its actuators,
the pool. (part of :mod:`zloader._defaults`)."""

# --- broker -------------------------------------------------------------------------------

HEARTBEAT_RANGE = (0.05, 60.0)
"""Heartbeat intervals a broker may use, in seconds (bounds ``zloader-broker
--heartbeat``; a peer refuses an announced interval outside it)."""

LIVENESS = 3
"""Heartbeats a peer may miss before the broker takes it for dead (``State(liveness=)``)."""

KILLS_TO_FAIL = 3
"""A split that was being read by a dying worker this many times is reported, not re-run
(fixed)."""

FENCE_GRACE = 10
"""Expiries (``liveness`` heartbeats each) a fence waits for a consumer that went silent: a
stalled consumer that comes back still answers, so what it holds is not read again
(fixed)."""

COMPACT_LINES = 100_000
"""The journal is rewritten without collected jobs once it has this many lines (fixed)."""

KEEP_EPOCHS = 2
"""Epochs before a coordinated job's current one whose round counts are kept, for late
consumers (fixed)."""

KEEP_RESOLVED = 4096
"""Recently committed or lost rounds remembered, to answer a consumer that asks again
(fixed)."""

START_TIMEOUT = 10.0
"""How long starting a broker thread waits for its socket to be bound
(``Broker.start(timeout=)``)."""

CLOSE_SECONDS = 5.0
"""How long closing a broker thread waits for its loop to stop (``Broker.close(timeout=)``)."""

BROKER_BEATS_AT_ONCE = 100
"""The broker sends its workers' HEARTBEATs this many at a time, reading what came in
between: a fleet's thousand beats in one go would hold up every answer behind them."""

BROKER_POLL_SECONDS = 0.05
"""The longest wait for a message of a broker loop on the main thread (the CLI's): how soon
it sees SIGTERM. One on a thread of its own (a Loader's) is woken by ``close()``, and
waits for the next message or heartbeat."""

# --- broker: floods and exhaustion (docs/reliability.md, "Floods") ------------------------

MAX_JOBS = 1024
"""Jobs a broker holds at once; a REGISTER of one more is refused with ERROR
(``zloader-broker --max-jobs``, ``Limits.jobs``)."""

MAX_PEER_JOBS = 16
"""Jobs one connection (a consumer's socket) may have made and still hold; a Loader makes
one (``zloader-broker --max-peer-jobs``, ``Limits.peer_jobs``)."""

MAX_PIPELINE_BYTES_HELD = 256 << 20
"""Bytes of pickled pipelines a broker keeps for its jobs, all together (a Loader sends at
most INLINE_PIPELINE_BYTES; larger ones its workers fetch from it): ``zloader-broker
--max-pipeline-bytes``, ``Limits.pipeline_bytes``."""

MAX_PEER_PIPELINE_BYTES = 32 << 20
"""Bytes of pickled pipelines the jobs of one connection may hold in the broker
(``zloader-broker --max-peer-pipeline-bytes``, ``Limits.peer_pipeline_bytes``)."""

UNHEARD_BEATS = 2
"""A consumer that has sent nothing since its REGISTER (no HEARTBEAT, no EPOCH) for this
many heartbeats is taken for one that does not read: its job has no claim on the pool's
busy workers until it does (a Loader's first heartbeat comes within one; a flood's
REGISTERs never read; fixed)."""

BROKER_TURN_SECONDS = 0.05
"""The longest the broker reads messages before it looks at its timers (heartbeats, the
tick that places workers): a flood of requests delays them by this much at most (fixed)."""

REFUSALS_LOGGED_EVERY = 5.0
"""Seconds between two log lines about refused REGISTERs (the count is in STATUS; fixed)."""

STATUS_REPLY_BYTES = 768 << 10
"""Bytes of workers and jobs one STATUS reply carries, at most; the rest is counted, and
asked for with ``from`` (``zloader status --all``; fixed: below MAX_BODY_BYTES)."""

STATUS_LIST_ITEMS = 64
"""Entries of a list inside one job of a STATUS reply (a shared job's trainers, the
hosts of its consumers); the rest is counted (fixed)."""

HANDSHAKE_SECONDS = 10.0
"""A connection to the broker that has not finished its ZeroMQ handshake (the security
handshake, with keys) within this long is closed (ZMQ_HANDSHAKE_IVL; fixed)."""

BROKER_SEND_WAIT_SECONDS = 10.0
"""How long a worker waits for room in its queue to the broker, once the broker has
answered on that connection, before it gives up saying the broker is not reading."""

DESCRIPTORS_LOW = 0.9
"""Share of the broker process's file-descriptor limit in use at which it warns, and drops
connections that have not finished their handshake, oldest first (fixed)."""

DESCRIPTORS_IDLE_SECONDS = 0.5
"""A connection without a finished handshake this old may be dropped when descriptors run
low: an honest peer's takes milliseconds (fixed)."""

DESCRIPTORS_CHECK_SECONDS = 0.25
"""Seconds between two counts of the broker's open descriptors while connections come in,
and at each heartbeat otherwise (fixed)."""

DESCRIPTORS_WARN_SECONDS = 10.0
"""Seconds between two warnings that descriptors run low (fixed)."""

# --- autoscaling and actuators (zloader/broker/autoscale.py, zloader/actuator.py) ----------------

AUTOSCALE_UP = 0.07
"""Starvation above which the autoscaler adds a worker, and the gain each addition must
buy to be followed by another (``Autoscaler(up=)``)."""

AUTOSCALE_DOWN = 0.03
"""Starvation below which the autoscaler removes a worker, and the cost a removal may have
(``Autoscaler(down=)``)."""

AUTOSCALE_COOLDOWN = 30.0
"""Seconds of starvation samples between two changes of a job's desired workers
(``Broker(cooldown=)``, ``zloader-broker --autoscale-cooldown``)."""

AUTOSCALE_MIN_WORKERS = 1
"""Fewest workers the autoscaler asks for a job (``Autoscaler(min_workers=)``)."""

AUTOSCALE_MAX_WORKERS = 4096
"""Most workers the autoscaler asks for a job (``Autoscaler(max_workers=)``); the fleet's
own limits (an actuator's ``--max-processes``, ``max_workers``) hold it lower: an addition
they do not carry out is given up and becomes a ceiling for a while."""

AUTOSCALE_HOLD = 10
"""Cooldowns a floor or ceiling set by an undone step first lasts, then doubles
(``Autoscaler(hold=)``)."""

START_SECONDS = 60.0
"""How long actuators get to add the workers asked for (two cooldowns if longer): a new
process starts in a second, a Ray actor or a Kubernetes pod can take much longer
(fixed)."""

ACTUATOR_EXPIRY = 10.0
"""Seconds after an actuator's last status request that the broker stops counting its cap
(``STATUS.actuator``) in the fleet's (fixed)."""

MAX_ACTUATOR_CAP = 1 << 20
"""The largest cap an actuator may report (``STATUS.actuator.cap``; fixed)."""

ACTUATOR_INTERVAL = 1.0
"""Seconds between two looks of an actuator at the broker's status
(``zloader-worker --autoscale-interval``, ``ProcessActuator(interval=)``,
``zloader.ray.Autoscaler(interval=)``)."""

REMOTE_DELAY = 5.0
"""Seconds a shortfall lasts before an actuator grows without consumers of the job on its
host (``remote_delay=`` of the process and Ray actuators)."""

RESTART_DELAY = 1.0
"""Seconds ``zloader-worker --processes N`` waits before replacing a worker process that
died; doubled at each death of that slot's processes, up to ``RESTART_MAX_DELAY``, so a
process that always dies does not spin (``--restart-delay``)."""

RESTART_MAX_DELAY = 60.0
"""The longest wait before ``zloader-worker --processes N`` replaces a dead worker process
(``--restart-max-delay``)."""

RESTART_RESET_SECONDS = 60.0
"""A worker process that ran this long before it died is replaced after
``RESTART_DELAY`` again, not after its slot's doubled delay (fixed)."""

SUPERVISE_POLL = 0.2
"""Seconds between two looks of ``zloader-worker --processes N`` at its children (fixed)."""

ACTOR_READY_SECONDS = 30.0
"""How long a Ray worker actor asked for its worker's id waits for the worker's loop to
run (fixed)."""

RAY_START_TIMEOUT = 120.0
"""Seconds ``zloader.ray.start_workers`` waits for every actor to run
(``start_timeout=``)."""

# --- pool: several jobs on one pool of workers (zloader/broker/pool.py) -------------------

SLICE_SECONDS = 1.0
"""A worker pool with more hungry jobs than workers time-slices: a job with no worker takes
one that has served another job this long (fixed)."""

MAX_FANOUT = 1 << 16
"""``JobOptions.balanced`` and ``num_consumers`` (``Loader(balanced=, num_consumers=)``):
at most this many consumers."""

WEIGHT_RANGE = (0.001, 1000.0)
"""``Loader(weight=)``, ``REGISTER.options.weight``: a job's share of the pool relative to other
jobs' lies in this range (docs/pool.md)."""

HUNGRY_STARVATION = 0.02
"""A job whose consumers waited for data more than this share of the last heartbeat
interval is hungry: the pool may move a worker to it (fixed)."""

HUNGRY_HOLD_BEATS = 3
"""A job sampled hungry stays hungry for this many heartbeat intervals, whatever the next
samples say: one low sample (heartbeats read late by a busy broker) must not make it give
its workers away and take them back a second later (fixed)."""

MOVES_PER_SECOND = 32.0
"""Workers the pool moves between jobs, at most, per second (a burst of as many at once):
a fleet's rebalancing goes at this pace, so one decision never moves hundreds of workers
in a tick, and a late broker never churns the fleet (docs/pool.md; fixed)."""

OVERDRAW_RECORDS = 1 << 16
"""Records a worker draining to move may make and send beyond its consumers' credits (it
finishes the splits it took; their remainder is far less)."""

DRAINED_TASKS_KEPT = 16
"""A job's tasks that left it cleanly (drained to move, or a BYE after SIGTERM), the
latest this many, listed in its view (``JOB.drained``): each sent its END last, so its
consumers read it until that END even after the view drops it (zloader/client/peers.py;
fixed)."""

MOVE_DRAIN_SECONDS = 10.0
"""A worker the pool moves off a job that does not run exactly-once first finishes the
splits it took (``RELEASE.drain``); one not done within this many seconds is moved at
once, and its split under way is read again by the job's other workers (docs/pool.md)."""
