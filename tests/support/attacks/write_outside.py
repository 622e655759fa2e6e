# Write a file outside any sandbox: the host's /tmp, the home directory, and the working
# directory of the processes above it. The file is left there (named kf-attack-outside-*):
# only the machine outside can tell whether it landed outside the sandbox, and the suite
# looks for it there (and removes it).
targets = ["/tmp", os.path.expanduser("~"), "/root"]
for pid in ancestors():
    try:
        targets.append(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        pass
for directory in dict.fromkeys(targets):
    try:
        with open(os.path.join(directory, f"kf-attack-outside-{os.getpid()}.txt"), "w") as handle:
            handle.write("written by a candidate\n")
    except OSError:
        pass
