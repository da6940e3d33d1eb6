"""Traces: a real OTLP/gRPC receiver (the opentelemetry-proto service definitions, served with
grpcio in this test) collects Ferrite's spans; a request sent with a W3C traceparent must produce
spans in that trace, under the caller's span, over HTTP and gRPC."""

import os
import queue
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from conftest import free_port, http_call, make_repository

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
# The servers' span exporter sends every 0.2 s (OpenTelemetry's standard variable; its default
# is 5 s), so each test waits for its spans a fraction of a second, not an interval or two.
EXPORT_DELAY_MS = 200
os.environ["OTEL_BSP_SCHEDULE_DELAY"] = str(EXPORT_DELAY_MS)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = queue.Queue()

    def Export(self, request, context):
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self.spans.put(span)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    r = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    r.endpoint = f"http://127.0.0.1:{port}"
    yield r
    server.stop(0)


def collect(receiver, trace_id, names, timeout=20):
    """Spans of `trace_id` until every name in `names` has been seen."""
    got = {}
    deadline = time.time() + timeout
    while time.time() < deadline and not names <= {s.name for s in got.values()}:
        try:
            span = receiver.spans.get(timeout=0.5)
        except queue.Empty:
            continue
        if span.trace_id.hex() == trace_id or span.name == "batch":
            got[span.span_id.hex()] = span
    return got


def mlp_input(module, n=1):
    i = module.InferInput("input", [n, 512], "FP32")
    i.set_data_from_numpy(np.ones((n, 512), np.float32))
    return i


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_caller_trace_continues_through_the_request(start_server, tmp_path, receiver, front):
    repo = make_repository(tmp_path / "repo", ("mlp",))
    # Sampling 0: only requests that carry a trace context are traced.
    s = start_server("--otlp-endpoint", receiver.endpoint, "--trace-sample-rate", "0", repository=repo)
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    if front == "http":
        http_call(s.url, lambda c: c.infer("mlp", [mlp_input(httpclient)], headers={"traceparent": traceparent}))
    else:
        grpcclient.InferenceServerClient(s.grpc_url).infer("mlp", [mlp_input(grpcclient)], headers={"traceparent": traceparent})
    spans = collect(receiver, TRACE_ID, {"receive", "validate", "queue", "batch"})
    by_name = {}
    for span in spans.values():
        by_name.setdefault(span.name, []).append(span)
    receive = by_name["receive"][0]
    assert receive.trace_id.hex() == TRACE_ID
    assert receive.parent_span_id.hex() == PARENT_ID
    for name in ("validate", "queue"):
        assert by_name[name][0].trace_id.hex() == TRACE_ID
        assert by_name[name][0].parent_span_id == receive.span_id
    # The batch span links to the request span it served.
    queue_ids = {sp.span_id for sp in by_name["queue"]}
    linked = [b for b in by_name["batch"] if any(l.span_id in queue_ids and l.trace_id.hex() == TRACE_ID for l in b.links)]
    assert linked, by_name["batch"]


def test_requests_without_context_are_sampled_by_rate(start_server, tmp_path, receiver):
    repo = make_repository(tmp_path / "repo", ("mlp",))
    s = start_server("--otlp-endpoint", receiver.endpoint, "--trace-sample-rate", "0", repository=repo)
    c = httpclient.InferenceServerClient(s.url)
    for _ in range(5):
        c.infer("mlp", [mlp_input(httpclient)])
    time.sleep(10 * EXPORT_DELAY_MS / 1000)  # past the span exporter's interval, several times
    names = []
    while not receiver.spans.empty():
        names.append(receiver.spans.get().name)
    assert "receive" not in names, names
