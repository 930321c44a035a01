package kvconsumer

import "testing"

// The bridge's two entry id layouts (connectors/redis.py entry_id), as the Python consumer reads them.
func TestEntryPositionReadsBothLayouts(t *testing.T) {
	cases := []struct {
		id   string
		want Pos
	}{
		{"1099511627777-0", Pos{1, 1, 0}},                             // narrow: epoch 1, seq 0
		{"1110506744053760-18446744073709551615", Pos{1010, 0, Last}}, // narrow EventsLost at slot 0
		{"9225168036854775808-704643075", Pos{1796000000000000, 42, 3}},
		{"9225168036854775808-721420287", Pos{1796000000000000, 42, Last}}, // wide: the slot's last
	}
	for _, c := range cases {
		got, err := EntryPosition(c.id)
		if err != nil || got != c.want {
			t.Errorf("EntryPosition(%q) = %v, %v; want %v", c.id, got, err, c.want)
		}
	}
	a, _ := EntryPosition("1110506744053760-5")
	b, _ := EntryPosition("9225168036854775808-0")
	if !a.Less(b) {
		t.Errorf("a narrow id must sort below every wide one")
	}
}
