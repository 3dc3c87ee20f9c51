"""Admission policies (jaxinfer.admission) on the scheduler alone: CPU, runs anywhere.

    python benchmarks/admission_cpu.py --out DIR [--sections simulate,host-cost]

``simulate``: throughput-1k's shape (1000 requests, 1000-token prompts, 1000 output tokens, a
budget of 8192, pages of 32) over the pool one H200 holds for Llama-3.1-8B (``--kv-cache-dtype``
bf16: 27,437 pages, 878k tokens; fp8 weights and KV: 58,219 pages, 1.86M tokens), driven step by
step by a fake engine that appends a token per sampling item; with ``--early-stop-fractions`` of
the requests stopping at a uniformly drawn length instead (an EOS). Per variant (policy,
``max_num_seqs``, the ratio learned from finished sequences or SGLang's fixed schedule, the tail
exception or none): preemptions, steps, tokens computed (the recomputed prefills included), the
most running at once, and a modelled output rate. A step costs the larger of the weight read
(16 GB in bf16, 8 in fp8) and its tokens' matmuls (2 x 8B FLOP each), plus the K/V its sequences
attend over read at ``--attention-efficiency`` of ``--read-tb-s``, plus ``--step-overhead-ms``
(defaults per dtype: ``POOLS``). Calibrated on H200 runs of throughput-1k. bf16 (session 10): it
gives 9,670 / 8,707 / 9,316 tok/s for greedy at 384 sequences / greedy at 1024 / the
fixed-schedule reserve at 1024, against 9,799 / 8,873 / 9,159 measured, and the preemptions within
one (0 / 379 / 119 against 0 / 380 / 120). fp8 (sessions 10 and 12): greedy's schedule 14,004
against 14,034 and 14,095 measured (47 preemptions against 48), and a step of 76 sequences at
~1500 tokens of context 11.0 ms against 11.2. A model, not a measurement:
``engine_throughput.py --admission`` on the GPU is.

``chat-burst``: 512 chat requests at once, prompts of 200-2000 tokens, no ``max_tokens`` (budgets
of up to 4096 tokens each), outputs exponentially distributed around 300 tokens, ``max_num_seqs``
256, the same pool and step-time model: what holding the ratio at 1.0 until requests finish costs
the time to first token, against SGLang's schedule and greedy.

``online``: 3000 requests arriving one by one (``--online-rates`` a second), prompts of 200-2000
tokens, outputs exponential around 400, with and without ``max_tokens`` 1024: whether admitting the
tail of a short queue early (the tail exception) starts preemption storms when arrivals outrun
the pool, against greedy and against no tail exception.

``host-cost``: ``Scheduler.schedule`` + ``postprocess`` per step with 1024 running decodes: with
no waiting queue, with one whose prompt the pool cannot take (both policies check the head and
refuse it each step), and, for reserve alone, with one refused by the projection (built each
step); policies interleaved round by round, the median of the rounds' means kept, the
reserve/greedy ratio beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxinfer.admission import ADMISSION_POLICIES, AdmissionConfig  # noqa: E402
from jaxinfer.page_allocator import PageAllocator  # noqa: E402
from jaxinfer.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from jaxinfer.sequence import Sequence  # noqa: E402

import json  # noqa: E402

NAME = "admission_cpu"
KV_VALUES_PER_TOKEN = 32 * 8 * 128 * 2  # Llama-3.1-8B: layers x kv heads x head_dim x (K, V)
FLOP_PER_TOKEN = 2 * 8.0e9
# Per KV cache dtype (with weights of the same width): the pool one H200 holds for Llama-3.1-8B,
# the bytes a step reads, and the step-time model's constants, calibrated on H200 runs of
# throughput-1k (bf16: session 10's three; fp8: sessions 10 and 12, greedy's schedule, and the
# tail steps of session 12's run, 76 sequences at 11.2 ms).
POOLS = {
    "bf16": dict(num_pages=27_437, bytes_per_value=2, weight_bytes=16.0e9, matmul_tflop_s=650.0,
                 attention_efficiency=0.9, step_overhead_ms=1.5),
    "fp8": dict(num_pages=58_219, bytes_per_value=1, weight_bytes=8.0e9, matmul_tflop_s=850.0,
                attention_efficiency=0.98, step_overhead_ms=7.5),
}


def log(line: str, lines: list[str]) -> None:
    print(line, flush=True)
    lines.append(line)


@dataclasses.dataclass(frozen=True)
class StepModel:
    """The model of one step's time (the module docstring): the larger of the weight read and the
    tokens' matmuls, the K/V its sequences attend over, a fixed overhead."""

    read_tb_s: float
    matmul_tflop_s: float
    attention_efficiency: float
    step_overhead_s: float
    weight_bytes: float = 16.0e9
    kv_bytes_per_token: int = KV_VALUES_PER_TOKEN * 2

    def seconds(self, schedule) -> float:
        read_bytes_per_s = self.read_tb_s * 1e12
        num_context = sum(item.start_position + item.num_new_tokens for item in schedule.items)
        matmul_s = schedule.num_batched_tokens * FLOP_PER_TOKEN / (self.matmul_tflop_s * 1e12)
        return (max(self.weight_bytes / read_bytes_per_s, matmul_s) + self.step_overhead_s
                + num_context * self.kv_bytes_per_token / (self.attention_efficiency * read_bytes_per_s))


def make_scheduler(policy: str, *, learn_from_finished: bool, initial_ratio: float, num_pages: int, page_size: int,
                   max_num_seqs: int, budget: int, max_model_len: int, tail_fraction: float | None = None) -> Scheduler:
    tail = {} if tail_fraction is None else dict(tail_fraction=tail_fraction)
    admission = AdmissionConfig(policy=policy, learn_from_finished=learn_from_finished, initial_ratio=initial_ratio,
                                **tail)
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, page_size, 0.0, admission)
    return Scheduler(config, PageAllocator(num_pages, page_size, "simulated"))


def fake_step(scheduler: Scheduler, model: StepModel, stop_after: dict[int, int], now: float,
              first_token_s: dict[int, float], done_s: dict[int, float] | None = None):
    """One step of a fake engine at modelled time ``now``: a token per sampling item, sequence
    ``i`` finishing after ``stop_after[i]``; records first-token (and finish) times at the
    step's end. Returns the schedule, the step's modelled end and how many ran in it."""
    schedule = scheduler.schedule(1e9)
    now += model.seconds(schedule)
    scheduler.postprocess(schedule)
    num_running = scheduler.num_running
    for item in schedule.items:
        if item.samples_token:
            seq_id = item.seq.seq_id
            first_token_s.setdefault(seq_id, now)
            item.seq.append_token(7)
            if item.seq.num_generated_tokens >= stop_after[seq_id]:
                scheduler.finish(item.seq, "stop")
                if done_s is not None:
                    done_s[seq_id] = now
    return schedule, now, num_running


def run_to_completion(scheduler: Scheduler, stop_after: dict[int, int], model: StepModel) -> dict:
    """Step a fake engine (a token per sampling item; sequence ``i`` stops after ``stop_after[i]``)
    until every sequence is done: steps, tokens computed, the most running at once, the modelled
    seconds, and each sequence's first token's modelled time."""
    num_steps = num_computed = most_running = 0
    modelled_s = 0.0
    first_token_s: dict[int, float] = {}
    while scheduler.num_waiting or scheduler.num_running:
        schedule, modelled_s, num_running = fake_step(scheduler, model, stop_after, modelled_s, first_token_s)
        num_steps += 1
        num_computed += schedule.num_batched_tokens
        most_running = max(most_running, num_running)
    return dict(steps=num_steps, tokens_computed=num_computed, most_running=most_running, seconds=modelled_s,
                first_token_s=first_token_s)


def simulate(policy: str, model: StepModel, *, num_requests: int, prompt_len: int, output_len: int, num_pages: int,
             page_size: int, max_num_seqs: int, budget: int, early_stop_fraction: float,
             learn_from_finished: bool = True, initial_ratio: float = 1.0, tail_fraction: float | None = None,
             seed: int = 0) -> dict:
    scheduler = make_scheduler(policy, learn_from_finished=learn_from_finished, initial_ratio=initial_ratio,
                               num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs, budget=budget,
                               max_model_len=2 * (prompt_len + output_len), tail_fraction=tail_fraction)
    rng = random.Random(seed)
    stop_after = {}
    for i in range(num_requests):
        scheduler.add(Sequence(i, f"r{i}", [rng.randrange(1, 100_000) for _ in range(prompt_len)],
                               arrival_time=0.0, max_tokens=output_len))
        early = rng.random() < early_stop_fraction
        stop_after[i] = rng.randrange(1, output_len) if early else output_len
    run = run_to_completion(scheduler, stop_after, model)
    output_tokens = sum(stop_after.values())
    return dict(policy=policy, max_num_seqs=max_num_seqs, learn_from_finished=learn_from_finished,
                initial_ratio=initial_ratio, tail_fraction=scheduler.config.admission.tail_fraction,
                early_stop_fraction=early_stop_fraction, preemptions=scheduler.num_preemptions,
                steps=run["steps"], tokens_computed=run["tokens_computed"],
                tokens_recomputed=run["tokens_computed"] - num_requests * prompt_len - output_tokens + num_requests,
                most_running=run["most_running"], output_tokens=output_tokens,
                modelled_output_tokens_per_s=output_tokens / run["seconds"])


def chat_burst(policy: str, model: StepModel, *, learn_from_finished: bool, initial_ratio: float, num_pages: int,
               seed: int = 0) -> dict:
    scheduler = make_scheduler(policy, learn_from_finished=learn_from_finished, initial_ratio=initial_ratio,
                               num_pages=num_pages, page_size=32, max_num_seqs=256, budget=8192, max_model_len=8192)
    rng = random.Random(seed)
    stop_after = {}
    for i in range(512):
        prompt = [rng.randrange(1, 100_000) for _ in range(rng.randint(200, 2000))]
        scheduler.add(Sequence(i, f"r{i}", prompt, arrival_time=0.0))
        stop_after[i] = min(int(rng.expovariate(1 / 300)) + 1, 4000)
    run = run_to_completion(scheduler, stop_after, model)
    ttft = sorted(run["first_token_s"].values())
    return dict(policy=policy, learn_from_finished=learn_from_finished, initial_ratio=initial_ratio,
                preemptions=scheduler.num_preemptions, ttft_mean_s=statistics.fmean(ttft),
                ttft_p90_s=ttft[int(0.9 * len(ttft))],
                modelled_output_tokens_per_s=sum(stop_after.values()) / run["seconds"])


def online(policy: str, model: StepModel, *, rate: float, max_tokens: int | None, num_pages: int,
           tail_fraction: float | None = None, num_requests: int = 3000, seed: int = 0) -> dict:
    """Requests arriving one by one (Poisson, ``rate`` a second of modelled time), prompts of
    200-2000 tokens, outputs exponential around 400 tokens (at most 4000 or ``max_tokens``),
    ``max_num_seqs`` 1024: preemptions, time to first token and end to end, in modelled seconds."""
    scheduler = make_scheduler(policy, learn_from_finished=True, initial_ratio=1.0, num_pages=num_pages, page_size=32,
                               max_num_seqs=1024, budget=8192, max_model_len=8192, tail_fraction=tail_fraction)
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    stop_after, first_token_s, done_s = {}, {}, {}
    now, num_added = 0.0, 0
    while num_added < num_requests or scheduler.num_waiting or scheduler.num_running:
        while num_added < num_requests and arrivals[num_added] <= now:
            prompt = [rng.randrange(1, 100_000) for _ in range(rng.randint(200, 2000))]
            scheduler.add(Sequence(num_added, f"r{num_added}", prompt, arrival_time=now, max_tokens=max_tokens))
            stop_after[num_added] = min(int(rng.expovariate(1 / 400)) + 1, max_tokens or 4000)
            num_added += 1
        if not (scheduler.num_waiting or scheduler.num_running):
            now = arrivals[num_added]  # idle until the next arrival
            continue
        _, now, _ = fake_step(scheduler, model, stop_after, now, first_token_s, done_s)
    ttft = sorted(first_token_s[i] - arrivals[i] for i in range(num_requests))
    return dict(policy=policy, learn_from_finished=True, tail_fraction=scheduler.config.admission.tail_fraction,
                rate=rate, max_tokens=max_tokens, preemptions=scheduler.num_preemptions,
                ttft_mean_s=statistics.fmean(ttft), ttft_p90_s=ttft[int(0.9 * len(ttft))],
                e2e_mean_s=statistics.fmean(done_s[i] - arrivals[i] for i in range(num_requests)),
                modelled_output_tokens_per_s=sum(stop_after.values()) / now)


def table(title: str, columns: list[str], rows: list[list]) -> list[str]:
    """A markdown section: its title and a table of ``rows`` (cells already formatted)."""
    return [f"\n## {title}\n", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def label(row: dict) -> str:
    if row["policy"] == "greedy":
        return "greedy"
    if not row["learn_from_finished"]:
        return "reserve, fixed schedule (SGLang)"
    return "reserve (default)" if row.get("tail_fraction", 0.1) > 0 else "reserve, no tail exception"


WAITING_CASES = {
    "empty": "empty",
    "too-big": "refused every step: the prompt does not fit",
    "projected": "refused every step by the projection (reserve only)",
}


def host_cost_round(policy: str, *, num_running: int, waiting: str, num_steps: int) -> float:
    """Mean seconds of schedule + postprocess per steady decode step."""
    page_size, prompt_len = 32, 33  # the first decodes fill page 2: no page is taken while timing
    if num_steps > 2 * page_size - prompt_len - 2:
        raise ValueError(f"--steps {num_steps}: at most {2 * page_size - prompt_len - 2} fit in two pages a sequence")
    # "too-big": room for every sequence's expected growth (reserve admits them all), not for the
    # first chunk of a waiting prompt (greedy refuses it too). "projected": a waiting prompt of one
    # page fits, but not beside the running set's growth (max_tokens 1000 each): reserve builds
    # its projection and refuses each step (greedy would admit it, so only reserve is timed; the
    # running set is admitted as greedy would, then the policy turns to reserve).
    projected = waiting == "projected"
    spare_pages = num_running
    num_pages = 1 + num_running * 2 + spare_pages
    # Seats free (max_num_seqs above the running count) and a budget that covers every prompt in
    # one step and leaves the waiting prompt a first chunk of more pages than are free.
    budget = num_running * prompt_len + 2 * page_size
    waiting_prompt_len = page_size if waiting == "projected" else budget
    config = SchedulerConfig(num_running + 64, budget, budget + 2048, page_size, 0.0,
                             AdmissionConfig(policy="greedy" if projected else policy))
    scheduler = Scheduler(config, PageAllocator(num_pages, page_size, "host-cost"))
    rng = random.Random(1)
    for i in range(num_running):
        scheduler.add(Sequence(i, f"r{i}", [rng.randrange(1, 100_000) for _ in range(prompt_len)],
                               arrival_time=0.0, max_tokens=1000 if projected else num_steps + 2))

    def step() -> float:
        start = time.perf_counter()
        schedule = scheduler.schedule(1e9)
        scheduler.postprocess(schedule)
        seconds = time.perf_counter() - start
        for item in schedule.items:
            if item.samples_token:
                item.seq.append_token(7)
        return seconds

    step()  # every prompt at once
    assert scheduler.num_running == num_running
    if projected:
        scheduler.admission.is_reserving, scheduler.admission.ratio = True, 1.0
    if waiting != "empty":
        for i in range(8):
            scheduler.add(Sequence(num_running + i, f"w{i}", [rng.randrange(1, 100_000) for _ in range(waiting_prompt_len)],
                                   arrival_time=0.0, max_tokens=100))
    times = [step() for _ in range(num_steps)]
    assert scheduler.num_running == num_running and scheduler.num_preemptions == 0
    return statistics.fmean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default="simulate,chat-burst,online,host-cost")
    parser.add_argument("--online-rates", default="20,30", help="arrivals a second for the online section")
    parser.add_argument("--early-stop-fractions", default="0,0.5,0.9")
    parser.add_argument("--kv-cache-dtype", choices=sorted(POOLS), default="bf16",
                        help="the pool and step-time constants below default to this dtype's (POOLS)")
    parser.add_argument("--num-pages", type=int)
    parser.add_argument("--read-tb-s", type=float, default=4.4)
    parser.add_argument("--matmul-tflop-s", type=float)
    parser.add_argument("--attention-efficiency", type=float)
    parser.add_argument("--step-overhead-ms", type=float)
    parser.add_argument("--num-running", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    pool = POOLS[args.kv_cache_dtype]
    for name in ("num_pages", "matmul_tflop_s", "attention_efficiency", "step_overhead_ms"):
        if getattr(args, name) is None:
            setattr(args, name, pool[name])
    sections = args.sections.split(",")
    lines: list[str] = []
    info = {"command": "python3 " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
            "host": platform.node()}
    for key, value in info.items():
        log(f"{key}: {value}", lines)
    results: dict = {"info": info}
    model = StepModel(args.read_tb_s, args.matmul_tflop_s, args.attention_efficiency, args.step_overhead_ms / 1e3,
                      pool["weight_bytes"], KV_VALUES_PER_TOKEN * pool["bytes_per_value"])
    results["model"] = dict(kv_cache_dtype=args.kv_cache_dtype, num_pages=args.num_pages, **dataclasses.asdict(model))
    markdown = [f"# Admission on the scheduler alone (CPU)\n\n`{info['command']}`\n\nStep-time model: "
                f"{results['model']}\n"]
    if "simulate" in sections:
        rows = []
        # (policy, max_num_seqs, learned ratio, initial ratio, tail fraction): greedy at 384 is the
        # bf16 run that never preempts; SGLang's schedule starts at 0.7 (session 10's default);
        # the last row holds every candidate to its whole expected run (no tail exception).
        variants = [("greedy", 384, True, 1.0, None), ("greedy", 1024, True, 1.0, None),
                    ("reserve", 1024, False, 0.7, None), ("reserve", 1024, True, 1.0, None),
                    ("reserve", 1024, True, 1.0, 0.0)]
        for fraction in map(float, args.early_stop_fractions.split(",")):
            for policy, max_num_seqs, learn, initial, tail_fraction in variants:
                row = simulate(policy, model, num_requests=1000, prompt_len=1000, output_len=1000,
                               num_pages=args.num_pages, page_size=32, max_num_seqs=max_num_seqs, budget=8192,
                               early_stop_fraction=fraction, learn_from_finished=learn, initial_ratio=initial,
                               tail_fraction=tail_fraction)
                log(f"simulate {row}", lines)
                rows.append(row)
        results["simulate"] = rows
        markdown += table("throughput-1k's shape, simulated",
                          ["early-stop fraction", "admission", "max_num_seqs", "preemptions", "steps",
                           "tokens recomputed", "most running", "modelled output tok/s"],
                          [[r["early_stop_fraction"], label(r), r["max_num_seqs"], r["preemptions"], r["steps"],
                            r["tokens_recomputed"], r["most_running"], f"{r['modelled_output_tokens_per_s']:.0f}"]
                           for r in rows])
    if "chat-burst" in sections:
        rows = []
        for policy, learn, initial in [("greedy", True, 1.0), ("reserve", False, 0.7), ("reserve", True, 1.0)]:
            row = chat_burst(policy, model, learn_from_finished=learn, initial_ratio=initial, num_pages=args.num_pages)
            log(f"chat-burst {row}", lines)
            rows.append(row)
        results["chat_burst"] = rows
        markdown += table("A burst of 512 chat requests without max_tokens, 256 sequences at most, simulated",
                          ["admission", "preemptions", "mean TTFT s", "p90 TTFT s", "modelled output tok/s"],
                          [[label(r), r["preemptions"], f"{r['ttft_mean_s']:.2f}", f"{r['ttft_p90_s']:.2f}",
                            f"{r['modelled_output_tokens_per_s']:.0f}"] for r in rows])
    if "online" in sections:
        rows = []
        for rate in map(float, args.online_rates.split(",")):
            for max_tokens in (None, 1024):
                for policy, tail_fraction in [("greedy", None), ("reserve", None), ("reserve", 0.0)]:
                    row = online(policy, model, rate=rate, max_tokens=max_tokens, num_pages=args.num_pages,
                                 tail_fraction=tail_fraction)
                    log(f"online {row}", lines)
                    rows.append(row)
        results["online"] = rows
        markdown += table("Steady arrivals, 3000 requests, outputs ~400 tokens, 1024 sequences at most, simulated",
                          ["arrivals/s", "max_tokens", "admission", "preemptions", "mean TTFT s", "p90 TTFT s",
                           "mean end to end s", "modelled output tok/s"],
                          [[f"{r['rate']:g}", r["max_tokens"] or "none (4096 held)", label(r), r["preemptions"],
                            f"{r['ttft_mean_s']:.2f}", f"{r['ttft_p90_s']:.2f}", f"{r['e2e_mean_s']:.2f}",
                            f"{r['modelled_output_tokens_per_s']:.0f}"] for r in rows])
    if "host-cost" in sections:
        cases = [(policy, waiting) for waiting in WAITING_CASES for policy in ADMISSION_POLICIES
                 if not (waiting == "projected" and policy == "greedy")]
        per_round = {case: [] for case in cases}
        for _ in range(args.rounds):  # interleaved: every case sees the same machine load
            for case in cases:
                per_round[case].append(host_cost_round(case[0], num_running=args.num_running, waiting=case[1],
                                                       num_steps=args.steps))
        median = {case: statistics.median(times) for case, times in per_round.items()}
        rows = []
        for waiting in WAITING_CASES:
            greedy = median.get(("greedy", waiting), median[("greedy", "empty")])
            row = dict(num_running=args.num_running, waiting_queue=waiting, greedy_us=greedy * 1e6,
                       greedy_case="empty" if ("greedy", waiting) not in median else waiting,
                       reserve_us=median[("reserve", waiting)] * 1e6,
                       reserve_over_greedy=median[("reserve", waiting)] / greedy)
            log(f"host-cost {row}", lines)
            rows.append(row)
        results["host_cost"] = rows
        markdown += table(f"schedule + postprocess per decode step, {args.num_running} running "
                          f"(median of {args.rounds} interleaved rounds of {args.steps} steps)",
                          ["waiting queue", "greedy µs", "reserve µs", "reserve / greedy"],
                          [[WAITING_CASES[r["waiting_queue"]],
                            f"{r['greedy_us']:.0f}" + (" (empty queue)" if r["greedy_case"] != r["waiting_queue"] else ""),
                            f"{r['reserve_us']:.0f}", f"{r['reserve_over_greedy']:.3f}"] for r in rows])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{NAME}.md").write_text("\n".join(markdown) + "\n")
    (args.out / f"{NAME}.log").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / NAME}.{{json,md,log}}")


if __name__ == "__main__":
    main()
