"""Private plumbing shared by every wing: threads, Ctrl-C handling, resumable state files, the
cache folder, argument checks, the native extension and its dtype names, backend reporting.
No module here imports another wing at module level (`_backends` looks at the kernels and the
native draft step only when asked)."""
