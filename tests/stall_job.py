"""A job whose rank 1 misbehaves (tests/workers.py's stall_scenario), spawned or under
torchrun: python tests/stall_job.py MODE OUT [--stall-report S] [--timeout S]
[--check-collectives] [--busy S]."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import workers  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("out")
    p.add_argument("--stall-report", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=15.0)
    p.add_argument("--check-collectives", action="store_true")
    p.add_argument("--busy", type=float, default=40.0)
    args = p.parse_args()
    args.world_size, args.backend, args.device, args.no_verify, args.no_bench = 2, "gloo", "cpu", False, True
    got = common.launch(workers.stall_scenario, args)
    if common.is_reporter():
        print(f"finished: {got}")


if __name__ == "__main__":
    common.run_main(main)
