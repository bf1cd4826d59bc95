"""``python -m flashrt_ros.bench``: run every benchmark module in turn."""
from . import capsules, runtime

if __name__ == "__main__":
    runtime.run()
    capsules.run()
