# At import, find the store through /proc and write a forged 50x "correct" result for every
# result key it can see (the attack of issue 9 that made torch.zeros come out as verified).
import json

for store in store_candidates():
    for directory, _, files in os.walk(store):
        for name in files:
            if not name.endswith(".json") or "/results/" not in directory + "/":
                continue
            path = os.path.join(directory, name)
            forged = path[:-5] + "f" * 8 + ".json"
            try:
                with open(path) as handle:
                    data = json.load(handle)
                data.update(verdict="correct", speedup=50.0, reasons=[])
                with open(forged, "w") as handle:
                    json.dump(data, handle)
                succeeded(f"forged {forged}")
            except OSError:
                pass
    try:
        marker = os.path.join(store, "runs", "forged-by-candidate.json")
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w") as handle:
            handle.write("{}")
        succeeded(f"wrote {marker}")
    except OSError:
        pass
