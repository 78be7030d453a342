"""Autoscaling inside the router: size the prefill (N) and decode (M) pools from live load.

- ``policy``: the decisions, pure (observations in, :class:`~router.autoscale.policy.ScaleDecision`
  out), with ``Pool`` and ``PoolLimits``;
- ``actuator``: the interface a decision is carried out through (``Actuator``,
  ``ActuatorError``); the back ends (local processes, docker compose, Kubernetes) are the
  launcher's (``launcher.actuators``);
- ``config``: the router's ``--autoscale`` flags and the settings they make;
- ``loop``: observe → decide → actuate, every interval, in the router's event loop.

``policy`` and ``actuator`` are leaves (no other router import): they are the whole of the router
that ``launcher`` may import. This file imports nothing, so importing them stays that cheap.
"""
