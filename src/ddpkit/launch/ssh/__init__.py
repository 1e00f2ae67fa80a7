"""`ddpkit launch ssh`: verified connections, host keys and hostfiles, the preflight of every host, and
each running node's channel.
"""
