"""Private plumbing shared by every wing: threads, Ctrl-C handling, resumable state files, the
cache folder, argument checks, the native extension and its dtype names, backend reporting.
Nothing here imports another wing."""
