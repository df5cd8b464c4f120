"""Why a process with llmbatch's CPU thread lowers the GIL switch interval (stages/base.py).

    python bench/loop_gil.py

An asyncio loop does socket round trips with an echo process (the engine's I/O: requests out,
outputs in), each followed by 10 hops from coroutine to coroutine (an output passing through
the tokenizer manager and the engine stage), for 3 s per line: (a) alone, (b) beside a thread
doing Python work (as the stages' template and tokenization do on the CPU thread), at Python's
default switch interval and at 0.2 ms, (c) with the same work on the loop itself in turns of
5 ms and 1 ms (an alternative that was tried and measured worse). Prints round trips per second
and how much of the Python work got done. Absolute figures depend on the machine; compare lines.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time


def work_unit() -> None:
    d = {}
    for i in range(200):
        d[str(i)] = [i, i * 2, "x"]


async def trial(mode: str, interval: float, seconds: float = 3.0, turn_s: float = 0.005, hops: int = 10) -> tuple[float, float]:
    sys.setswitchinterval(interval)
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echo process
        a.close()
        while data := b.recv(64):
            b.send(data)
        os._exit(0)
    b.close()
    a.setblocking(False)
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    units = [0]

    def thread_work() -> None:
        while not stop.is_set():
            work_unit()
            units[0] += 1

    async def turns() -> None:
        while not stop.is_set():
            end = time.perf_counter() + turn_s
            while time.perf_counter() < end:
                work_unit()
                units[0] += 1
            await asyncio.sleep(0)

    helper = None
    if mode == "thread":
        threading.Thread(target=thread_work, daemon=True).start()
    elif mode == "turns":
        helper = asyncio.ensure_future(turns())
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await loop.sock_sendall(a, b"ping")
        await loop.sock_recv(a, 64)
        for _ in range(hops):  # the output passes from coroutine to coroutine, one loop iteration each
            await asyncio.sleep(0)
        n += 1
    stop.set()
    if helper is not None:
        await helper
    a.close()
    os.waitpid(pid, 0)
    sys.setswitchinterval(0.005)
    return n / seconds, units[0] / seconds


def main() -> None:
    print("| Python work | switch interval | round trips/s | work units/s |")
    print("| --- | ---: | ---: | ---: |")
    for mode, interval, turn_s in [("none", 0.005, 0), ("thread", 0.005, 0), ("thread", 0.0002, 0),
                                   ("turns", 0.005, 0.005), ("turns", 0.005, 0.001)]:
        trips, units = asyncio.run(trial(mode, interval, turn_s=turn_s))
        where = {"none": "none", "thread": "on a thread", "turns": f"on the loop, {turn_s * 1000:g} ms turns"}[mode]
        print(f"| {where} | {interval * 1000:g} ms | {trips:,.0f} | {units:,.0f} |")


if __name__ == "__main__":
    main()
