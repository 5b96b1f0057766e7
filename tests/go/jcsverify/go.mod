module xidstream.test/jcsverify

go 1.22
