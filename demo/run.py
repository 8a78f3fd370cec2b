"""``kvscope demo``: the tiny model, a fleet of real vLLM CPU servers, the reference gateway in front of them,
the kvscope pipeline observing them, and the workload, all started in the background of one process while
the dashboard serves from the main thread. The workload's labels (its ground truth) are loaded into the store
every few seconds as the workload writes them (ingest/labels.py LabelTail), so the named query
attribution_agreement compares them with attribution while the demo runs."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

from ingest.errors import KvscopeError
from ingest.labels import LabelTail
from ingest.store import Store
from kvscope.config import Config
from kvscope.pipeline import Pipeline

log = logging.getLogger("kvscope.demo")
LABELS_EVERY_SECONDS = 5.0


class DemoRun:
    """Starts everything in a background thread (:meth:`start_background`); :meth:`close` stops it all.

    ``status`` is a one-line description of the current step, for the dashboard and the terminal.
    """

    def __init__(self, cfg: Config, store: Store, *, workdir: Path, pods: int = 2, scale: float = 1.0,
                 rounds: int = 0, seed: int = 0, alerts: tuple | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.workdir = Path(workdir)
        self.pods = pods
        self.scale = scale
        self.rounds = rounds
        self.seed = seed
        self.alerts = alerts  # (rules, notifier) for the pipeline's alert thread (kvscope/pipeline.py)
        self.stop = threading.Event()
        self.status = "starting"
        self.fleet = None
        self.gateway = None
        self.pipeline: Pipeline | None = None
        self.labels: LabelTail | None = None
        self._thread: threading.Thread | None = None

    def start_background(self) -> None:
        self._thread = threading.Thread(target=self._run_guarded, name="kvscope-demo", daemon=True)
        self._thread.start()

    def _run_guarded(self) -> None:
        try:
            self._run()
        except Exception as exc:  # the dashboard keeps serving what was collected
            self.status = f"demo failed: {exc!r}"
            log.exception("demo failed")

    def _step(self, text: str) -> None:
        self.status = text
        log.info(text)

    def _run(self) -> None:
        from demo.fleet import VllmFleet
        from demo.model import build_tiny_model
        from demo.workload import run_workload
        from gateway.proxy import GatewayServer, make_app

        self.workdir.mkdir(parents=True, exist_ok=True)
        self._step("building the tiny model (first run only)")
        model_dir = build_tiny_model()
        self.fleet = VllmFleet(model_dir, self.workdir / "logs", num_pods=self.pods)
        gw_log = self.workdir / "gateway.jsonl"
        cfg = replace(self.cfg, vllm=",".join(f"{p.name}={p.base_url}" for p in self.fleet.pods),
                      gateway_log=str(gw_log), kv_events_endpoint=self.fleet.kv_events_endpoint,
                      kv_events_replay=",".join(f"{p.kv_events_topic}={p.kv_replay_endpoint}" for p in self.fleet.pods))
        # The collector binds the KV-event socket before the pods start: vLLM drops what it publishes while
        # nobody listens, so this way the store gets every block event from seq 0.
        self.pipeline = Pipeline(cfg, store=self.store, stop=self.stop, alerts=self.alerts)
        self.pipeline.start()
        self._step(f"starting {self.pods} vLLM CPU servers (~2 min)")
        t0 = time.monotonic()
        self.fleet.start()
        log.info("vLLM fleet healthy. seconds=%.0f", time.monotonic() - t0)
        app = make_app([(p.name, p.base_url) for p in self.fleet.pods], gw_log, policy=self.cfg.routing_policy,
                       tokenizer_path=model_dir / "tokenizer.json", block_chain=self.cfg.gateway_block_chain,
                       block_size=self.cfg.gateway_block_size)
        self.gateway = GatewayServer(app, port=self.cfg.gateway_port)
        self.gateway.start()
        # rounds == 0: new conversations forever (tenants keep their prompts, as real tenants do)
        self._step(f"workload running via gateway {self.gateway.url}")
        run_id = time.strftime("%m%d%H%M%S")  # request ids stay unique across demo runs on the same store
        self.labels = LabelTail(self.store, self.workdir / f"labels-{run_id}.jsonl", run_id=run_id)
        threading.Thread(target=self._load_labels_loop, name="kvscope-demo-labels", daemon=True).start()
        labels = run_workload(self.gateway.url, seed=self.seed, scale=self.scale * max(1, self.rounds),
                              loop=self.rounds == 0, stop_event=self.stop, id_prefix=f"{run_id}-",
                              labels_path=self.labels.path, run_id=run_id)
        self._load_labels()
        self._step(f"workload finished after {len(labels)} requests; pipeline still collecting")

    def _load_labels_loop(self) -> None:
        while not self.stop.wait(LABELS_EVERY_SECONDS):
            self._load_labels()

    def _load_labels(self) -> None:
        """Load the label lines the workload completed since the last load (the workload ends each line with a
        newline; a line being written waits); a store error waits for the next load."""
        if self.labels is None:
            return
        try:
            self.labels.poll()
        except (KvscopeError, OSError) as exc:
            log.warning("workload labels not loaded yet (next try in %.0f s): %s", LABELS_EVERY_SECONDS, exc)

    def close(self) -> None:
        self.stop.set()
        self._load_labels()  # requests still in flight: `kvscope import labels` loads them later
        if self.pipeline:
            self.pipeline.close()
        if self.gateway:
            self.gateway.stop()
        if self.fleet:
            self.fleet.stop()
