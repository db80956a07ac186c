"""tests/site/: the tests' own changes to jax's compilation cache (cache_reuse.py), checked
where they once failed (a race between the test jobs that share one cache), and the
stacks a process the tests gave up on writes before it is killed."""

import subprocess
import sys
import textwrap
import time

import cache_reuse
import pytest

from runs import REPO, main_env, stacks_then_kill, two_processes_command, wait_for

pytestmark = pytest.mark.slow

# One small program compiled by a job of 2 processes over one cache directory. With
# MISS_ON_P1 set, process 1 finds no entry in the cache while process 0 finds it: what
# happens when another test's job writes the entry between the two processes' reads.
PROGRAM = textwrap.dedent('''
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    pid = int(os.environ["JDP_PROCESS_ID"])
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if pid == 1 and os.environ.get("MISS_ON_P1"):
        from jax._src import lru_cache
        lru_cache.LRUCache.get = lambda self, key: None
    jax.distributed.initialize(os.environ["JDP_COORDINATOR_ADDRESS"],
                               int(os.environ["JDP_NUM_PROCESSES"]), pid)
    mesh = jax.make_mesh((8,), ("d",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                               np.arange(4.0) + 4 * pid)
    total = jax.jit(lambda a: jnp.sum(a * 3.0))(x)
    print("total", float(total.addressable_data(0)))
''')


@pytest.mark.skipif(not cache_reuse.sharing_programs_works(),
                    reason="jax's sharing of programs hangs on this jaxlib's CPU "
                           "(tests/site/cache_reuse.py), so the tests do not share them")
def test_a_program_process_0_reads_from_the_cache_reaches_a_process_that_missed_it(tmp_path):
    script, cache = tmp_path / "program.py", tmp_path / "cache"
    script.write_text(PROGRAM)

    def job(**extra):
        env = {**main_env(), "JAX_SHARE_BINARY_BETWEEN_HOSTS": "true",
               "JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS": "60000", **extra}
        return subprocess.run(two_processes_command([sys.executable, str(script), str(cache)]),
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    first = job()  # both miss; process 0 compiles, writes the entry and shares it
    assert first.returncode == 0, first.stderr[-3000:]
    assert any(cache.iterdir())
    second = job(MISS_ON_P1="1")  # process 0 hits, process 1 misses and waits for it
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("total 84.0") == 2, second.stdout


def test_a_hung_process_tree_writes_where_each_process_waited_before_it_is_killed(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time

        def waiting_in_a_collective():
            open(os.path.join(sys.argv[1], f"ready.{os.getpid()}"), "w").close()
            time.sleep(600)

        if sys.argv[2:] == ["launcher"]:  # its trainer, a child process, hangs too
            subprocess.Popen([sys.executable, __file__, sys.argv[1]])
        waiting_in_a_collective()
    """))
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path), "launcher"],
                                env=main_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready.*"))) == 2, 60, "both processes")
    finally:
        started = time.monotonic()
        stacks_then_kill(launcher, grace_s=0.5)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == -9 and time.monotonic() - started < 20
    # Both processes, the launcher and its child, wrote their main thread's stack, one
    # after the other (they share one stderr).
    assert stderr.count("line 6 in waiting_in_a_collective\n") == 2, stderr
