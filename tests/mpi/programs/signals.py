"""Signal handling: SIGUSR1 diagnostics while the job keeps running; SIGTERM shutdown; with ``stuck``, every rank
blocks its event loop (it never sees a signal it handles)."""

import asyncio
import os
import sys
import time
from pathlib import Path

import mpiscale


class Holder(mpiscale.Actor):
    """Holds an ask open until the release file exists (visible in diagnostics)."""

    async def hold(self, release: str) -> str:
        while not Path(release).exists():
            await asyncio.sleep(0.02)
        return "released"

    def hit(self, n: int) -> None:
        pass


async def main(system):
    mode, folder = sys.argv[1], Path(sys.argv[2])
    holders = await system.spawn_group(Holder, name="holder")
    (folder / f"rank{system.rank}.pid").write_text(str(os.getpid()))
    peer = holders[(system.rank + 1) % system.size]
    if mode == "usr1":
        assert await peer.ask("hold", str(folder / "release")) == "released"
        await system.world.barrier()
        if system.rank == 0:
            print("released ok")
        return
    if mode == "stuck":
        time.sleep(600)
    n = 0
    while True:  # busy until a signal arrives
        peer.tell("hit", n)
        n += 1
        await asyncio.sleep(0.001)


mpiscale.run(main)
