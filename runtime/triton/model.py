"""What Triton's Python backend runs for a gsm-edge model: `TritonPythonModel` over the gsm-edge engine.

Decoupled: `execute` hands each request to the engine (continuous batching inside this model instance, the
same fallbacks as `runtime serve`) and returns at once; a thread per request sends its responses through
the request's response sender: with `stream` true one response per token (text_output = that token's text)
and a final empty one, else one response with the whole text. Errors are Triton errors on that request's
sender (a bad parameter names it, as the HTTP server's 400 does); the model lives on.

Metrics: the GSM series of `runtime serve` (same names) through the Python backend's custom metrics API, so
they appear on Triton's own /metrics beside nv_inference_*.

Run-time knobs: the config parameter `gsm_config_patch` (a JSON Patch, runtime.triton.repository.PATCH_PARAM) is
applied to the engine's knobs when the instance loads; a bad one fails the load naming the path. Changing it is a
reload with a config override (Triton's repository API): a new instance, the old one finishing its requests. The
instance logs the knobs (their document and checksum) and the generation (Engine.config_generation: 1 with a patch,
else 0) to Triton's log, and exports the generation as gsm_config_generation.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils  # the Python backend's module: this file runs inside Triton

if TYPE_CHECKING:
    from runtime.engine import Engine, EngineRequest, Observer

log = logging.getLogger("runtime.triton")

# generate-extension input -> (Runtime.request keyword, numpy cast)
SCALARS = {"temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
           "seed": ("seed", int)}


class GsmMetrics:
    """The engine's observer writing Triton custom metrics (names as runtime.serve.metrics exports them)."""

    def __init__(self, model: str, instance: str) -> None:
        C, G = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        fam = {n: pb_utils.MetricFamily(name=n, description=d, kind=k) for n, d, k in (
            ("gsm_requests_total", "Finished requests by finish reason", C),
            ("gsm_generation_tokens_total", "Generated tokens", C),
            ("gsm_prompt_tokens_total", "Prompt tokens of finished requests", C),
            ("gsm_fallbacks_total", "Fallback policies taken", C),
            ("gsm_running_sequences", "Sequences in the running batch", G),
            ("gsm_queue_depth", "Requests waiting", G),
            ("gsm_sparse_mask_hit_rate", "Sparse mask hit rate of the last probed decode step", G),
            ("gsm_shared_kv_noise_level", "Relative error the last re-tier pass added to the rows it re-encoded", G),
            ("gsm_spec_draft_tokens_total", "Drafted tokens verified (speculative decoding)", C),
            ("gsm_spec_accepted_tokens_total", "Drafted tokens the model's own tokens matched and kept", C),
            ("gsm_config_generation", "Run-time knob patches applied when this instance loaded (gsm_config_patch: "
                                      "1, else 0)", G),
        )}
        self.fam, self.labels, self.m = fam, {"model": model, "instance": instance}, {}
        # series whose label values are known exist from the start at 0 (Prometheus practice); the hit rate and
        # the KV noise appear once measured, never with a made-up value
        for name in ("gsm_generation_tokens_total", "gsm_prompt_tokens_total", "gsm_running_sequences",
                     "gsm_queue_depth", "gsm_spec_draft_tokens_total", "gsm_spec_accepted_tokens_total"):
            self.metric(name)
        for policy in ("hit_rate", "kv_noise"):
            self.metric("gsm_fallbacks_total", policy=policy)

    def metric(self, name: str, **labels: str) -> Any:
        key = (name, tuple(sorted(labels.items())))
        if key not in self.m:
            self.m[key] = self.fam[name].Metric(labels={**self.labels, **labels})
        return self.m[key]

    def observer(self) -> Observer:
        from runtime.engine import Observer

        outer = self

        class Obs(Observer):
            def on_finish(self, req: EngineRequest) -> None:
                outer.metric("gsm_requests_total", finish_reason=str(req.finish_reason)).increment(1)
                outer.metric("gsm_generation_tokens_total").increment(len(req.ids))
                outer.metric("gsm_prompt_tokens_total").increment(len(req.prompt_ids))

            def on_step(self, engine: Engine, running: Sequence[EngineRequest]) -> None:
                outer.metric("gsm_running_sequences").set(len(running))
                outer.metric("gsm_queue_depth").set(engine.queue_depth)

            def on_hit_rate(self, req: EngineRequest, hit_rate: float) -> None:
                outer.metric("gsm_sparse_mask_hit_rate").set(hit_rate)

            def on_kv_noise(self, req: EngineRequest, noise: float) -> None:
                outer.metric("gsm_shared_kv_noise_level").set(noise)

            def on_fallback(self, req: EngineRequest, policy: str, value: float) -> None:
                outer.metric("gsm_fallbacks_total", policy=policy).increment(1)

            def on_drafts(self, req: EngineRequest, drafted: int, accepted: int) -> None:
                outer.metric("gsm_spec_draft_tokens_total").increment(drafted)
                outer.metric("gsm_spec_accepted_tokens_total").increment(accepted)

        return Obs()


def log_info(msg: str) -> None:
    """To Triton's own log (the Python backend's Logger) where it has one, else to the logging module's."""
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        logger.log_info(msg)
    else:
        log.info("%s", msg)


def config_patch(engine: Engine, params: dict[str, str]) -> None:
    """Apply the config's PATCH_PARAM (a JSON Patch of the knobs; absent or empty: none) to `engine`'s knobs;
    KnobError naming the path (the load fails with it) unless it is JSON that Engine.patch takes."""
    from gsm.bundle_knobs import KnobError
    from runtime.triton.repository import PATCH_PARAM

    text = params.get(PATCH_PARAM, "").strip()
    if not text:
        return
    try:
        ops = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise KnobError(f"{PATCH_PARAM}: not JSON ({e})") from None
    try:
        engine.patch(ops)
    except KnobError as e:
        raise KnobError(f"{PATCH_PARAM}: {e}") from None


def _input(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _text(v: Any) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def parse_request(request: Any, n_max: int) -> tuple[str, int, bool, dict[str, Any]]:
    """(prompt, max_tokens, stream, Runtime.request keywords); ValueError naming the input."""
    text = _input(request, "text_input")
    if text is None or text.size != 1:
        raise ValueError("text_input: one string is required")
    prompt = _text(text.reshape(-1)[0])
    mt = _input(request, "max_tokens")
    max_tokens = 16 if mt is None else int(mt.reshape(-1)[0])  # OpenAI's and Triton's TensorRT-LLM default
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    st = _input(request, "stream")
    stream = bool(st.reshape(-1)[0]) if st is not None else False
    kw: dict[str, Any] = {"temperature": 0.0}
    for name, (key, cast) in SCALARS.items():
        v = _input(request, name)
        if v is not None:
            kw[key] = cast(v.reshape(-1)[0])
    stop = _input(request, "stop")
    if stop is not None and stop.size:
        kw["stop"] = [_text(s) for s in stop.reshape(-1)]
    spec = _input(request, "speculative")
    if spec is not None and spec.size:
        kw["speculative"] = _text(spec.reshape(-1)[0])  # "auto" | "off": Runtime.request names a bad one
    return prompt, max_tokens, stream, kw


def _response(text: str, reason: str | None, tokens: int) -> Any:
    """One response: text (a token's, or the whole), the finish reason ("" until the last), tokens so far."""
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([(reason or "").encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("completion_tokens", np.array([tokens], np.int32))])


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        import runtime
        from runtime.engine import Engine, EngineConfig
        from runtime.triton.repository import ALLOW_PARAM, DRAFT_PARAM
        from runtime.verdict import ALLOW_FAILED_VERIFY, refuse_failed

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        bundle = Path(params["bundle"])
        if not bundle.is_absolute():  # carried in the repository: relative to the model directory
            bundle = Path(args["model_repository"]) / bundle
        # verifies every file's hash
        self.rt = runtime.load(bundle, params.get("backend", "auto"), speculative=params.get("speculative", "auto"),
                               draft_bundle=params.get(DRAFT_PARAM))
        # a failed golden check on this backend refuses the model (Triton shows it UNAVAILABLE with this reason)
        self.verify = refuse_failed(bundle, self.rt.backend.name, flag=f"{ALLOW_FAILED_VERIFY} (runtime triton)",
                                    allow=params.get(ALLOW_PARAM) == "true")
        log.info("golden check on backend %s: %s", self.rt.backend.name, self.verify["status"])
        self.name = config["name"]
        self.engine = Engine(self.rt, EngineConfig(max_running=int(params.get("max_running", 0)),
                                                    max_queue=int(params.get("max_queue", 64))))
        config_patch(self.engine, params)  # before any request: every one this instance serves takes these knobs
        knobs = self.engine.knobs
        log_info(f"model {self.name}: knobs {knobs.checksum}, config generation {self.engine.config_generation}: "
                 f"{json.dumps(knobs.document(), sort_keys=True)}")
        instance = args.get("model_instance_name", self.name)
        self.metrics = GsmMetrics(self.name, instance) if hasattr(pb_utils, "MetricFamily") else None
        if self.metrics is not None:
            self.engine.observers.append(self.metrics.observer())
            # one series per instance name: a reload's new instance sets it (the old one's value is not left behind)
            self.metrics.metric("gsm_config_generation").set(self.engine.config_generation)
        self.engine.start()
        self.engine.ready.wait()
        if self.engine.warmup_error is not None:
            raise RuntimeError(f"warm-up failed on backend {self.rt.backend.name}: {self.engine.warmup_error}")
        self.threads: set[threading.Thread] = set()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, max_tokens, stream, kw = parse_request(request, self.rt.n_max)
                req = self.engine.submit(prompt, max_tokens, **kw)
            except Exception as e:  # a RequestError names the parameter; a full queue says so
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            t = threading.Thread(target=self._respond, args=(req, sender, stream), daemon=True)
            self.threads.add(t)
            t.start()
        return None

    def _respond(self, req: EngineRequest, sender: Any, stream: bool) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            sent = 0
            if stream:
                for tok in req:
                    if tok.text:
                        sent += len(tok.text)
                        sender.send(_response(tok.text, None, len(req.ids)))
            else:
                req.result()
            if req.finish_reason == "error":
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"generation failed: {req.error}")),
                            flags=final)
            else:  # streamed: the text held back before a stop id or string; else the whole text
                sender.send(_response((req.text or "")[sent:], req.finish_reason, len(req.ids)), flags=final)
        except Exception as e:  # the client went away, the server is stopping
            log.info("request %s: %s", getattr(req, "id", "?"), e)
            if not req.done:
                req.cancel()
        finally:
            self.threads.discard(threading.current_thread())

    def finalize(self) -> None:
        self.engine.close()
        for t in list(self.threads):
            t.join(5)
