package kvconsumer

import "testing"

// PartitionOf routes as the bridge does (aiokafka's DefaultPartitioner, murmur2 as Java's
// client): the expected partitions were computed with it, for 2, 3, 6 and 12 partitions.
func TestPartitionOfMatchesTheBridge(t *testing.T) {
	want := map[string][4]int{
		"a/0":           {1, 0, 3, 3},
		"b/0":           {0, 2, 2, 8},
		"llama-a/1":     {1, 0, 3, 9},
		"llama-b/0":     {0, 0, 0, 0},
		"engine.x/7":    {1, 2, 5, 11},
		"gpu-node-12/3": {0, 2, 2, 8},
	}
	for key, parts := range want {
		for i, n := range []int{2, 3, 6, 12} {
			ids := make([]int, n)
			for j := range ids {
				ids[j] = j
			}
			if got := PartitionOf(key, ids); got != parts[i] {
				t.Errorf("%s over %d partitions: %d, the bridge writes to %d", key, n, got, parts[i])
			}
		}
	}
}

// StreamOf and the StateLog read state keys as the Python StateLog does.
func TestStateLog(t *testing.T) {
	if StreamOf("llama-a/0/_head") != "llama-a/0" || StreamOf("a/b/3/-/-/00000000000000ff") != "a/b/3" {
		t.Fatal("StreamOf")
	}
	l := NewStateLog()
	l.Add("s/0/GPU/0/0000000000000001", []byte(`{"n":1}`))
	l.Add("s/0/_head", []byte(`{"h":1}`))
	l.Add("s/0/GPU/0/0000000000000001", nil) // a tombstone of the next write, no head yet
	l.Add("s/0/GPU/0/0000000000000002", []byte(`{"n":2}`))
	head, values := l.Newest("s/0")
	if string(head) != `{"h":1}` || len(values) != 1 || string(values[0]) != `{"n":2}` || !l.Open("s/0") {
		t.Fatalf("head %s values %q open %v", head, values, l.Open("s/0"))
	}
}
