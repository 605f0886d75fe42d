"""Wake-ups: after a commit, tell whoever waits that the database has something new.

- `message`: what a wake-up says, and how a transaction marks what it wrote;
- `publish`: every process publishes after its commits (Redis, or a signal file embedded);
- `hub`: the API process receives them for its open streams;
- `scheduler`: the scheduler receives "GPUs were freed" and starts a pass at once.
"""
