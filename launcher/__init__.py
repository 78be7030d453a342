"""``pdserve up`` and the actuators: starting and stopping pdserve processes.

- ``cluster``, ``cluster_config``, ``cluster_demo``, ``local_store``: ``pdserve up`` (a whole
  cluster on this machine: KV store, router, nodes; ``--demo``);
- ``ports``: the router's ports held before anything starts (a busy one: one line);
- ``processes``: child processes (own session, ready line, cluster marker, sweep, death with
  their parent);
- ``reaper``, ``state``, ``down``: a cluster outliving `up` (its watchdog, its state file,
  ``pdserve down``);
- ``actuators``: the autoscaler's back ends (local processes, docker compose, Kubernetes);
- ``health_check``: ``pdserve health``, the probe of container healthchecks;
- ``demo``: ``pdserve demo``, offline generation on a built-in model.

NOTE on the dependency with the router. The launcher starts the router as a process
(``python -m pdserve_cli router ...``) and never imports its serving code. It does import two
leaves of ``router.autoscale``: ``policy`` (``Pool``, ``PoolLimits``) and ``actuator`` (the
``Actuator`` protocol and ``ActuatorError``), which import nothing else of the router. Why the
interface lives with the router rather than here: the autoscale loop is the actuators' only
caller and defines what it needs of them, and the router must not depend on the launcher at
import time, while an actuator necessarily depends on the pool vocabulary. So the arrow points
one way, launcher → router.autoscale's leaves; the router reaches the back ends only when it
autoscales, through imports inside the functions that build them at start-up
(``router.autoscale.config``; ``router.server.serve`` for the address local nodes dial back).
``tests/launcher/test_layering.py`` checks both directions.
"""
