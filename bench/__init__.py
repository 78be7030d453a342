"""``pdserve bench``: load generation against a pdserve endpoint, SLO math and reports.

- ``load``: the workload (random or file prompts, open-loop arrivals), the load runner and the
  ``pdserve bench`` command (``python -m bench.load`` too);
- ``client``: the HTTP (OpenAI, SSE) and gRPC senders, one ``RequestRecord`` per request;
- ``http_stream``: the HTTP transport, which stamps each server-sent event when its bytes are
  read (an asyncio protocol on uvloop, JSON parsed after the stream), so ITL stays right under
  load;
- ``report``: report.json / report.md / records.jsonl and the PNG plots (matplotlib, imported
  only here);
- ``slo``: TTFT / ITL / TPOT / E2E, attainment and goodput. The router's live ``/slo`` report and
  its metrics import it too, so a benchmark and the live router use one definition of every
  number. ``slo`` needs only numpy: the router imports it and nothing else of this package.
"""
