import os, sys, time, shutil, threading, importlib.util, statistics, torch, torch.distributed as dist
sys.path.insert(0, "/work/main")
import common, sharded_checkpoint as new
spec = importlib.util.spec_from_file_location("old_sc", "/tmp/ck/old_sc.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
dist.init_process_group("gloo", rank=0, world_size=1)
lm = common.build_lm("small", 128, torch.device("cpu"), 0)
opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)
lm(*common.lm_batch(2, 128, 0, 0, torch.device("cpu"))).backward(); opt.step()
def rss():
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) / 1024
times = {"old": [], "new": []}; grow = {"old": [], "new": []}
for rep in range(5):
    for name, m in (("new", new), ("old", old)) if rep % 2 else (("old", old), ("new", new)):
        d = f"/tmp/ck/a-{name}"; shutil.rmtree(d, ignore_errors=True)
        start, peak, done = rss(), [0], [False]
        def sample():
            while not done[0]:
                peak[0] = max(peak[0], rss()); time.sleep(0.001)
        th = threading.Thread(target=sample); th.start()
        t0 = time.perf_counter(); m.save_sharded(lm, opt, d, 1); times[name].append(time.perf_counter() - t0)
        done[0] = True; th.join(); grow[name].append(peak[0] - start)
        shutil.rmtree(d, ignore_errors=True)
for n in times:
    print(n, "save s", [round(x, 2) for x in times[n]], "median", round(statistics.median(times[n]), 2), "rss growth MB", [round(x) for x in grow[n]])
dist.destroy_process_group()
