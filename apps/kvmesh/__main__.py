from kvmesh.apps.cli import main

main()
