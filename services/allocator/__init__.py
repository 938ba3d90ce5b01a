"""The allocator service: requests in, joint GPU + NIC placements committed with CAS, out."""
