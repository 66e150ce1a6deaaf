from kvmesh.cli import main

main()
