from megarl.rollout.server.app import main

main()
