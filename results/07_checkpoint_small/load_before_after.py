import os, sys, time, shutil, threading, torch, torch.distributed as dist
sys.path.insert(0, "/work/main")
import common, sharded_checkpoint as sc
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29535")
dist.init_process_group("gloo", rank=0, world_size=1)
lm = common.build_lm("small", 128, torch.device("cpu"), 0)
opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)
lm(*common.lm_batch(2, 128, 0, 0, torch.device("cpu"))).backward(); opt.step()
d = "/tmp/ck/lm"; shutil.rmtree(d, ignore_errors=True); f = sc.save_sharded(lm, opt, d, 1)
def rss():
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) / 1024
for rep in range(3):
    lm2 = common.build_lm("small", 128, torch.device("cpu"), 1); opt2 = torch.optim.AdamW(lm2.parameters(), lr=1e-4)
    start, peak, done = rss(), [0], [False]
    def sample():
        while not done[0]:
            peak[0] = max(peak[0], rss()); time.sleep(0.001)
    th = threading.Thread(target=sample); th.start()
    t0 = time.perf_counter(); sc.load_sharded(lm2, opt2, f); t = time.perf_counter() - t0
    done[0] = True; th.join()
    ok = all(torch.equal(a, b) for a, b in zip(lm.state_dict().values(), lm2.state_dict().values()))
    print(f"load {t:.2f}s peak growth {peak[0]-start:.0f} MB (with AdamW state) exact {ok}", flush=True)
    del lm2, opt2
dist.destroy_process_group()
