"""A stand-in for a MaxText training, run by mtpipe's runner as its child: `python -m
fakes.fake_maxtext MODULE STEPS SECONDS` prints MaxText's step lines, one every SECONDS."""

import sys
import time

if __name__ == "__main__":
    steps, seconds = int(sys.argv[2]), float(sys.argv[3])
    for step in range(steps):
        time.sleep(seconds)
        print(f"completed step: {step}, seconds: {seconds}, TFLOP/s/device: 0.01, Tokens/s/device: 1000.0, "
              f"total_weights: 512, loss: {3.0 - step * 0.1:.3f}", flush=True)
