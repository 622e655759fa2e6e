# Delete every run it can find in the store.
import shutil

for store in store_candidates():
    runs = os.path.join(store, "runs")
    for name in os.listdir(runs) if os.path.isdir(runs) else []:
        try:
            shutil.rmtree(os.path.join(runs, name))
            succeeded(f"deleted run {name}")
        except OSError:
            pass
