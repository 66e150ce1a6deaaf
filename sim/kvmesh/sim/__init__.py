"""The simulator (`kvmesh replay`): virtual-time replay of traces through the live code.

* `trace`: Mooncake JSONL traces, the infinite-cache prefix bound, prompt expansion;
* `config`: `ReplayConfig` (with the live `MockerConfig` and `DisaggConfig`), the flags;
* `policies`: the live routing policies over simulated workers (`KvScheduler`, `pick_simple`);
* `cluster`: the virtual-time cluster (live `MockerScheduler`s, a policy, one event loop);
* `replay`: aggregated replay; `disagg`: prefill and decode pools, with the gateway's
  conditional disaggregation (`local_prefill_reason`);
* `results`: per-request timeline and the summary (`ModeResult`);
* `main`: the command: runs the replays, prints tables or JSON lines, plots.
"""
