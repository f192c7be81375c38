/* autotp plan view: draws one Plan (embedded as JSON) as a collapsible module-hierarchy graph.
 *
 * Model: every graph node and every inserted collective is a *leaf*; leaves live in the module
 * tree (model -> layers -> attention / MLP -> ops). Runs of identical layers are *folds* that
 * show one representative layer. Each expanded group is laid out on its own as a small layered
 * DAG of its visible children (leaves, collapsed groups, expanded groups as boxes), so the
 * page only lays out what is visible and an 80-layer plan stays fast.
 * No network, no libraries: plain DOM + SVG.
 */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("autotp-plan-data").textContent);
  var META = DATA.meta;
  var NODE_W = 176, NODE_H = 38, COLL_W = 188, COLL_H = 40, GROUP_W = 196, GROUP_H = 46;
  var PAD = 12, HEAD = 24, HGAP = 18, VGAP = 26;
  var SPLIT_COLOURS = ["#1971c2", "#2f9e44", "#9c36b5", "#c2255c", "#0c8599", "#5c940d"];

  // ------------------------------------------------------------------ formatting
  function fmtS(s, signed) {
    if (s === null || s === undefined) return "-";
    var sign = signed ? (s >= 0 ? "+" : "\u2212") : (s < 0 ? "\u2212" : "");
    var v = Math.abs(s);
    if (v >= 1) return sign + v.toFixed(3) + " s";
    if (v >= 1e-3) return sign + (v * 1e3).toFixed(3) + " ms";
    return sign + (v * 1e6).toFixed(1) + " \u00b5s";
  }
  function fmtB(b, signed) {
    var sign = signed ? (b >= 0 ? "+" : "\u2212") : "";
    var v = Math.abs(b), units = [["GiB", 1073741824], ["MiB", 1048576], ["KiB", 1024]];
    for (var i = 0; i < units.length; i++) if (v >= units[i][1]) return sign + (v / units[i][1]).toFixed(2) + " " + units[i][0];
    return sign + v + " B";
  }
  function esc(t) {
    return String(t).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  }
  function clip(t, n) { t = String(t); return t.length <= n ? t : t.slice(0, n - 1) + "\u2026"; }
  function colour(p) {
    if (!p || p === "R") return "#8c959f";
    if (p === "P") return "#e8590c";
    var m = /^S\((-?\d+)\)/.exec(p);
    if (m) return SPLIT_COLOURS[Math.abs(parseInt(m[1], 10)) % SPLIT_COLOURS.length];
    return "#57606a";
  }
  function tint(p) {
    if (!p || p === "R") return "#f3f4f6";
    if (p === "P") return "#fff1e6";
    var m = /^S\((-?\d+)\)/.exec(p);
    if (m) return ["#e7f0fb", "#e9f6ec", "#f5e9f8", "#fbe8ef", "#e3f5f7", "#eef6e3"][Math.abs(parseInt(m[1], 10)) % 6];
    return "#f3f4f6";
  }
  function isBlock(p) { return /x\d+$/.test(p || ""); }
  function tag(p) { return '<span class="tag" style="border-color:' + colour(p) + ";background:" + tint(p) + '">' + esc(p) + "</span>"; }
  function shortOp(op) {
    if (op === "placeholder" || op === "output") return op;
    var parts = op.split(".");
    return parts.length >= 2 ? parts[1] : op;
  }
  function collKind(c) {
    var steps = c.steps.filter(function (s) { return s !== "slice" && s !== "zero"; });
    return (steps.length ? steps : c.steps).join("+") || "reshard";
  }

  // ------------------------------------------------------------------ leaves
  var leaves = [];   // {id, kind: "node"|"coll", index, group, order, data}
  var byName = {};
  DATA.nodes.forEach(function (n, i) {
    var leaf = { id: "n" + i, kind: "node", index: i, order: i, data: n, ins: [], outs: [] };
    leaves.push(leaf);
    byName[n.n] = leaf;
  });
  DATA.collectives.forEach(function (c, i) {
    var leaf = { id: "c" + i, kind: "coll", index: i, order: c.p + 0.5, data: c, ins: [], outs: [] };
    leaves.push(leaf);
  });
  var edges = [];   // {from: leaf, to: leaf, placement}
  (function buildEdges() {
    var collFor = {};  // producer index + "|" + dst + "|" + consumer index -> collective leaf
    leaves.forEach(function (leaf) {
      if (leaf.kind !== "coll") return;
      var c = leaf.data;
      edges.push({ from: leaves[c.p], to: leaf, placement: c.src });
      c.c.forEach(function (consumer) { collFor[c.p + "|" + c.dst + "|" + consumer] = leaf; });
    });
    DATA.nodes.forEach(function (n, i) {
      var seen = {};
      n.a.forEach(function (p, slot) {
        var coll = collFor[p + "|" + n.i[slot] + "|" + i];
        var from = coll || leaves[p];
        var key = from.id;
        if (seen[key]) return;
        seen[key] = true;
        edges.push({ from: from, to: leaves[i], placement: coll ? coll.data.dst : DATA.nodes[p].o });
      });
    });
    edges.forEach(function (e) { e.from.outs.push(e); e.to.ins.push(e); });
  })();
  // Placeholders come first in the graph; order them just before their first reader instead,
  // so that modules sort by when they run, not by when their weights were registered.
  leaves.forEach(function (leaf) {
    if (leaf.kind !== "node" || leaf.data.op !== "placeholder" || !leaf.outs.length) return;
    leaf.order = Math.min.apply(null, leaf.outs.map(function (e) { return e.to.order; })) - 0.25;
  });
  // Placeholders nobody reads (e.g. a use_cache flag) only clutter the drawing.
  leaves.forEach(function (leaf) {
    leaf.hidden = leaf.kind === "node" && leaf.data.op === "placeholder" && leaf.outs.length === 0;
  });

  // ------------------------------------------------------------------ module tree
  var groups = [];
  function makeGroup(kind, name, fqn, parent) {
    var g = { id: "g" + groups.length, kind: kind, name: name, fqn: fqn, parent: parent, children: [], leaves: [],
              expanded: false, order: Infinity };
    groups.push(g);
    if (parent) parent.children.push(g);
    return g;
  }
  var root = makeGroup("module", META.title || "model", "", null);
  root.expanded = true;
  var groupByFqn = { "": root };
  function groupFor(fqn) {
    if (groupByFqn[fqn]) return groupByFqn[fqn];
    var cut = fqn.lastIndexOf(".");
    var parent = groupFor(cut < 0 ? "" : fqn.slice(0, cut));
    var g = makeGroup("module", cut < 0 ? fqn : fqn.slice(cut + 1), fqn, parent);
    groupByFqn[fqn] = g;
    return g;
  }
  leaves.forEach(function (leaf) {
    if (leaf.hidden) return;
    var g = groupFor(leaf.kind === "node" ? leaf.data.m : leaf.data.m);
    g.leaves.push(leaf);
    leaf.group = g;
  });
  // A module with submodules and many ops of its own gets its ops in one collapsible group.
  groups.slice().forEach(function (g) {
    if (g.kind !== "module" || g.children.length === 0 || g.leaves.length <= 12) return;
    var ops = makeGroup("ops", g.leaves.length + " ops of " + (g.name || "model"), g.fqn, g);
    ops.leaves = g.leaves;
    g.leaves = [];
    ops.leaves.forEach(function (leaf) { leaf.group = ops; });
  });
  // Folds: runs of identical layers show their first layer.
  DATA.runs.forEach(function (run) {
    var members = run.members.map(function (f) { return groupByFqn[f]; }).filter(Boolean);
    if (members.length < 2) return;
    var container = members[0].parent;
    var first = run.members[0], last = run.members[run.members.length - 1];
    var label = first.slice(first.lastIndexOf(".", first.lastIndexOf(".") - 1) + 1) + "\u2013" + last.slice(last.lastIndexOf(".") + 1);
    var fold = makeGroup("fold", label, first, null);
    fold.parent = container;
    fold.members = members;
    fold.rep = members[0];
    fold.count = members.length;
    fold.unfolded = false;
    var at = container.children.indexOf(members[0]);
    container.children = container.children.filter(function (c) { return members.indexOf(c) < 0; });
    container.children.splice(at < 0 ? container.children.length : at, 0, fold);
    members.forEach(function (m) { m.fold = fold; });
  });
  // Order key of a group: the earliest leaf in it (the graph is topologically ordered).
  function computeOrder(g) {
    var o = Infinity;
    g.leaves.forEach(function (l) { o = Math.min(o, l.order); });
    (g.kind === "fold" ? g.members : g.children).forEach(function (c) { o = Math.min(o, computeOrder(c)); });
    g.order = o;
    return o;
  }
  computeOrder(root);
  // Aggregates shown on collapsed boxes and in details.
  function aggregate(g) {
    if (g.agg) return g.agg;
    var a = { ops: 0, compute: 0, comm: 0, weights: {}, weightBytes: 0, colls: {}, last: null, lastOrder: -1, leaves: [] };
    function addLeaf(l) {
      a.leaves.push(l);
      if (l.kind === "node") {
        var n = l.data;
        if (n.op !== "placeholder" && n.op !== "output") a.ops += 1;
        a.compute += n.c;
        if (n.w !== undefined) { a.weights[n.o] = (a.weights[n.o] || 0) + 1; a.weightBytes += n.w; }
      } else {
        a.comm += l.data.t;
        var k = collKind(l.data);
        if (k !== "slice" && k !== "zero") a.colls[k] = (a.colls[k] || 0) + 1;  // local steps are no collective
      }
      if (l.order > a.lastOrder && !(l.kind === "node" && l.data.op === "placeholder")) { a.lastOrder = l.order; a.last = l; }
    }
    g.leaves.forEach(addLeaf);
    var kids = g.kind === "fold" ? g.members : g.children;
    kids.forEach(function (c) {
      var ca = aggregate(c);
      ca.leaves.forEach(addLeaf);
    });
    g.agg = a;
    return a;
  }
  groups.forEach(aggregate);
  function outPlacement(item) {
    if (item.kind === "node") return item.data.o;
    if (item.kind === "coll") return item.data.dst;
    var last = aggregate(item).last;
    return last ? outPlacement(last) : "R";
  }

  // ------------------------------------------------------------------ visibility
  function displayParent(item) {
    var g = item.kind === "node" || item.kind === "coll" ? item.group : item.parent;
    if (item.fold && !item.fold.unfolded) return item.fold;
    return g;
  }
  function chainOf(item) {  // root ... item, along display parents
    var chain = [item], p = displayParent(item);
    while (p) { chain.push(p); p = displayParent(p); }
    return chain.reverse();
  }
  function visibleChildren(g) {
    if (g.kind === "fold") return [g.rep];
    var out = [];
    g.children.forEach(function (c) {
      if (c.kind === "fold" && c.unfolded) out = out.concat(c.members);
      else out.push(c);
    });
    return out.concat(g.leaves);
  }
  function visibleOf(leaf) {
    var chain = leaf.chain || (leaf.chain = chainOf(leaf));
    for (var i = 0; i < chain.length - 1; i++) {
      var g = chain[i];
      if (!g.expanded) return g;
      if (g.kind === "fold" && chain[i + 1] !== g.rep) return g;
    }
    return leaf;
  }
  function invalidateChains() { leaves.forEach(function (l) { l.chain = null; }); }

  // ------------------------------------------------------------------ layout
  function isGroup(item) { return item.kind === "node" || item.kind === "coll" ? 0 : 1; }
  function collapsedSize() { return { w: GROUP_W, h: GROUP_H }; }
  function leafSize(l) { return l.kind === "coll" ? { w: COLL_W, h: COLL_H } : { w: NODE_W, h: NODE_H }; }

  function layoutGroup(g, childEdges) {
    var kids = visibleChildren(g).filter(function (c) { return !c.hidden; });
    kids.sort(function (a, b) { return a.order - b.order || isGroup(a) - isGroup(b); });
    var idx = new Map();
    kids.forEach(function (c, i) { idx.set(c, i); });
    kids.forEach(function (c) {
      if (c.kind === "node" || c.kind === "coll") { var s = leafSize(c); c.w = s.w; c.h = s.h; }
      else if (c.expanded) layoutGroup(c, childEdges);
      else { var t = collapsedSize(c); c.w = t.w; c.h = t.h; }
    });
    var preds = kids.map(function () { return []; });
    (childEdges.get(g) || []).forEach(function (e) {
      var a = idx.get(e[0]), b = idx.get(e[1]);
      if (a === undefined || b === undefined || a === b) return;
      if (a < b) preds[b].push(a);
    });
    var rank = kids.map(function () { return 0; });
    kids.forEach(function (c, i) { preds[i].forEach(function (p) { rank[i] = Math.max(rank[i], rank[p] + 1); }); });
    var layers = [];
    kids.forEach(function (c, i) { (layers[rank[i]] = layers[rank[i]] || []).push(i); });
    var pos = kids.map(function () { return 0; });
    layers.forEach(function (layer) { layer.forEach(function (i, k) { pos[i] = k; }); });
    for (var sweep = 0; sweep < 3; sweep++) {
      layers.forEach(function (layer) {
        var bary = {};
        layer.forEach(function (i) {
          var ps = preds[i];
          bary[i] = ps.length ? ps.reduce(function (s, p) { return s + pos[p]; }, 0) / ps.length : pos[i];
        });
        layer.sort(function (a, b) { return bary[a] - bary[b] || a - b; });
        layer.forEach(function (i, k) { pos[i] = k; });
      });
    }
    var y = PAD + (g === root ? 0 : HEAD);
    var centre = kids.map(function () { return 0; });
    var maxRight = 0;
    layers.forEach(function (layer) {
      var h = 0, right = -Infinity;
      layer.forEach(function (i) {
        var c = kids[i];
        var want = preds[i].length ? preds[i].reduce(function (s, p) { return s + centre[p]; }, 0) / preds[i].length : -Infinity;
        var x = Math.max(want === -Infinity ? PAD : want - c.w / 2, right === -Infinity ? PAD : right + HGAP, PAD);
        c.x = x; c.y = y;
        centre[i] = x + c.w / 2;
        right = x + c.w;
        h = Math.max(h, c.h);
      });
      maxRight = Math.max(maxRight, right);
      y += h + VGAP;
    });
    g.w = Math.max(maxRight + PAD, g === root ? 0 : 240);
    g.h = Math.max(y - VGAP + PAD, HEAD + 20);
    g.kids = kids;
  }
  function place(g, ox, oy) {
    g.ax = ox; g.ay = oy;
    (g.kids || []).forEach(function (c) {
      c.ax = ox + c.x; c.ay = oy + c.y;
      if ((c.kind === "module" || c.kind === "ops" || c.kind === "fold") && c.expanded) place(c, c.ax, c.ay);
    });
  }

  // ------------------------------------------------------------------ drawing
  var svgHost = document.getElementById("graph");
  var zoom = 1;
  var drawn = {};      // item id -> item (for events)
  var selectedId = null;

  function edgePath(a, b) {
    var x1 = a.ax + a.w / 2, y1 = a.ay + a.h, x2 = b.ax + b.w / 2, y2 = b.ay;
    if (y2 < y1) {  // drawn upwards: leave to the right and come back
      var side = Math.max(a.ax + a.w, b.ax + b.w) + 14;
      return "M" + (a.ax + a.w) + "," + (a.ay + a.h / 2) + " C" + side + "," + (a.ay + a.h / 2) + " " + side + "," +
        (b.ay + b.h / 2) + " " + (b.ax + b.w) + "," + (b.ay + b.h / 2);
    }
    var dy = Math.max(18, (y2 - y1) / 2);
    return "M" + x1 + "," + y1 + " C" + x1 + "," + (y1 + dy) + " " + x2 + "," + (y2 - dy) + " " + x2 + "," + y2;
  }
  function leafSvg(l) {
    var x = l.ax, y = l.ay, w = l.w, h = l.h, s = [];
    s.push('<g class="leaf' + (l.id === selectedId ? " selected" : "") + '" data-id="' + l.id + '">');
    if (l.kind === "coll") {
      var c = l.data, k = 10;
      s.push('<polygon points="' + [x + k, y, x + w - k, y, x + w, y + h / 2, x + w - k, y + h, x + k, y + h, x, y + h / 2].join(",") +
             '" fill="#fff5f5" stroke="#c92a2a" stroke-width="1.6"/>');
      s.push('<text x="' + (x + w / 2) + '" y="' + (y + 16) + '" text-anchor="middle" font-size="12" font-weight="600" fill="#a61e1e">' +
             esc(collKind(c)) + " " + esc(c.src) + "\u2192" + esc(c.dst) + "</text>");
      s.push('<text x="' + (x + w / 2) + '" y="' + (y + 31) + '" text-anchor="middle" font-size="11" fill="#57606a">' +
             esc(fmtB(c.b)) + " \u00b7 " + esc(fmtS(c.t)) + "</text>");
    } else {
      var n = l.data, p = n.o, weight = n.op === "placeholder";
      s.push('<rect x="' + x + '" y="' + y + '" width="' + w + '" height="' + h + '" rx="' + (weight ? 12 : 4) + '" fill="' + tint(p) +
             '" stroke="' + colour(p) + '" stroke-width="1.4"' + (isBlock(p) ? ' stroke-dasharray="5,3"' : "") + "/>");
      s.push('<rect x="' + x + '" y="' + y + '" width="5" height="' + h + '" fill="' + colour(p) + '"/>');
      var title = weight ? (n.t ? n.t.slice(n.t.lastIndexOf(".") + 1) : n.n) : shortOp(n.op);
      var line2 = weight ? (n.s.length ? n.s.join("\u00d7") : "") : n.n;
      s.push('<text x="' + (x + 11) + '" y="' + (y + 15) + '" font-size="12" font-weight="600"' + (n.f ? ' fill="#cf222e"' : "") +
             ">" + esc(clip(title, 17)) + (n.f ? " \u26a0" : "") + "</text>");
      s.push('<text x="' + (x + w - 6) + '" y="' + (y + 15) + '" font-size="11" text-anchor="end" font-weight="600" fill="' +
             colour(p) + '">' + esc(p) + "</text>");
      s.push('<text x="' + (x + 11) + '" y="' + (y + 30) + '" font-size="10.5" fill="#57606a">' + esc(clip(line2, 19)) + "</text>");
      if (n.c) s.push('<text x="' + (x + w - 6) + '" y="' + (y + 30) + '" font-size="10.5" text-anchor="end" fill="#57606a">' +
                      esc(fmtS(n.c)) + "</text>");
    }
    s.push("</g>");
    return s.join("");
  }
  function groupStats(g) {
    var a = aggregate(g), parts = [a.ops + " ops"];
    var w = Object.keys(a.weights).sort().map(function (p) { return p + (a.weights[p] > 1 ? "\u00d7" + a.weights[p] : ""); });
    if (w.length) parts.push("W " + w.join(" "));
    var colls = Object.keys(a.colls).length ? Object.keys(a.colls).map(function (k) {
      return k.replace("all_reduce", "AR").replace("all_gather", "AG").replace("reduce_scatter", "RS") + "\u00d7" + a.colls[k];
    }).join(" ") : "";
    return { text: parts.join(" \u00b7 "), colls: colls, time: fmtS(a.compute + a.comm) };
  }
  function groupLabel(g) {
    if (g.kind === "fold") return g.label || (g.name + "  \u00d7" + g.count + " identical");
    return g.name || "model";
  }
  function groupSvg(g, depth, out) {
    var x = g.ax, y = g.ay, st = groupStats(g);
    var fold = g.kind === "fold";
    if (!g.expanded) {
      var p = outPlacement(g);
      out.push('<g class="collapsed' + (g.id === selectedId ? " selected" : "") + '" data-id="' + g.id + '">');
      out.push('<rect class="box" x="' + x + '" y="' + y + '" width="' + g.w + '" height="' + g.h + '" rx="6" fill="#fff" stroke="' +
               (fold ? "#6741d9" : "#6e7781") + '" stroke-width="1.4"' + (fold ? ' stroke-dasharray="6,3"' : "") + "/>");
      if (fold) out.push('<rect x="' + (x + 4) + '" y="' + (y + 4) + '" width="' + g.w + '" height="' + g.h +
                         '" rx="6" fill="none" stroke="#6741d9" stroke-opacity=".35"/>');
      out.push('<rect x="' + x + '" y="' + (y + g.h - 5) + '" width="' + g.w + '" height="5" fill="' + colour(p) + '"/>');
      out.push('<text x="' + (x + 8) + '" y="' + (y + 16) + '" font-size="12" font-weight="700">\u25b8 ' +
               esc(clip(groupLabel(g), Math.floor((g.w - 24 - 6 * st.time.length) / 7.3))) + "</text>");
      out.push('<text x="' + (x + g.w - 6) + '" y="' + (y + 16) + '" font-size="10.5" text-anchor="end" fill="#57606a">' + esc(st.time) + "</text>");
      out.push('<text x="' + (x + 8) + '" y="' + (y + 32) + '" font-size="10.5" fill="#57606a">' + esc(clip(st.text, 28)) + "</text>");
      if (st.colls) out.push('<text x="' + (x + g.w - 6) + '" y="' + (y + 32) + '" font-size="10.5" text-anchor="end" fill="#a61e1e">' +
                             esc(st.colls) + "</text>");
      out.push("</g>");
      return;
    }
    if (g !== root) {
      var fill = fold ? "#f7f4ff" : (depth % 2 ? "#f6f8fa" : "#fdfdfe");
      out.push('<rect x="' + x + '" y="' + y + '" width="' + g.w + '" height="' + g.h + '" rx="8" fill="' + fill + '" stroke="' +
               (fold ? "#6741d9" : "#c3ccd5") + '" stroke-width="1.2"' + (fold ? ' stroke-dasharray="6,3"' : "") + "/>");
      out.push('<g class="ghead" data-id="' + g.id + '"><rect x="' + x + '" y="' + y + '" width="' + g.w + '" height="' + HEAD +
               '" fill-opacity="0" fill="#fff"/><text x="' + (x + 8) + '" y="' + (y + 16) + '" font-size="12" font-weight="700">\u25be ' +
               esc(groupLabel(g)) + (g.kind === "module" && g.fqn && g.fqn !== g.name &&
               (groupLabel(g).length + g.fqn.length + st.time.length + 4) * 6.8 < g.w - 20 ? '<tspan font-weight="400" fill="#8c959f">  ' + esc(g.fqn) + "</tspan>" : "") +
               '</text><text x="' + (x + g.w - 8) + '" y="' + (y + 16) + '" font-size="10.5" text-anchor="end" fill="#57606a">' +
               esc(st.time) + "</text></g>");
    }
    g.kids.forEach(function (c) {
      if (c.kind === "node" || c.kind === "coll") return;
      groupSvg(c, depth + 1, out);
    });
  }
  function leavesSvg(g, out) {
    (g.kids || []).forEach(function (c) {
      if (c.kind === "node" || c.kind === "coll") { out.push(leafSvg(c)); drawn[c.id] = c; }
      else { drawn[c.id] = c; if (c.expanded) leavesSvg(c, out); }
    });
  }

  function render() {
    invalidateChains();
    drawn = {};
    // Edges between visible items, and the pairs each group lays out.
    var childEdges = new Map(), pairs = new Map();
    edges.forEach(function (e) {
      if (e.from.hidden || e.to.hidden) return;
      var a = visibleOf(e.from), b = visibleOf(e.to);
      if (a === b) return;
      var ca = chainOf(a), cb = chainOf(b), k = 0;
      while (k + 1 < ca.length && k + 1 < cb.length && ca[k + 1] === cb[k + 1]) k++;
      if (ca.indexOf(b) >= 0 || cb.indexOf(a) >= 0) return;  // into a fold from its own shown layer
      var lca = ca[k];
      var x = ca[k + 1] || a, y = cb[k + 1] || b;
      if (!childEdges.has(lca)) childEdges.set(lca, []);
      childEdges.get(lca).push([x, y]);
      var key = a.id + ">" + b.id;
      if (!pairs.has(key)) pairs.set(key, { a: a, b: b, placement: e.placement, n: 0 });
      pairs.get(key).n += 1;
    });
    layoutGroup(root, childEdges);
    place(root, 0, 0);
    var out = [], edgeOut = [];
    groupSvg(root, 0, out);
    pairs.forEach(function (p) {
      var split = p.placement && p.placement !== "R";
      edgeOut.push('<path class="edge" d="' + edgePath(p.a, p.b) + '" stroke="' + colour(p.placement) + '" stroke-width="' +
                   (split ? 2.2 : 1.2) + '" stroke-opacity="' + (split ? 0.9 : 0.55) + '"' + (isBlock(p.placement) ? ' stroke-dasharray="5,3"' : "") +
                   ' marker-end="url(#arrow-' + (split ? "s" : "r") + ')"/>');
    });
    var leafOut = [];
    leavesSvg(root, leafOut);
    drawn[root.id] = root;
    var w = Math.ceil(root.w + 20), h = Math.ceil(root.h + 20);
    svgHost.innerHTML = '<svg xmlns="http://www.w3.org/2000/svg" id="graph-svg" width="' + Math.ceil(w * zoom) + '" height="' +
      Math.ceil(h * zoom) + '" viewBox="0 0 ' + w + " " + h + '">' +
      '<defs><marker id="arrow-r" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" orient="auto-start-reverse">' +
      '<path d="M0,0 L8,4 L0,8 z" fill="#8c959f"/></marker><marker id="arrow-s" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" ' +
      'markerHeight="6" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" fill="#57606a"/></marker></defs>' +
      out.join("") + edgeOut.join("") + leafOut.join("") + "</svg>";
    var count = Object.keys(drawn).length;
    document.documentElement.setAttribute("data-autotp-visible", String(count));
    document.getElementById("visible-count").textContent = count + " items drawn, " + pairs.size + " edges";
  }

  // ------------------------------------------------------------------ details
  var details = document.getElementById("details-body");
  function nodeRow(i) {
    var n = DATA.nodes[i];
    return '<a href="#" data-goto="' + esc(n.n) + '" class="mono">' + esc(n.t || n.n) + "</a>";
  }
  function altTable(n) {
    if (!n.alt.length) return '<p class="note">' + (META.version < 2 ? "Alternatives are not recorded in format-v1 plans." :
                                                    "No other candidate strategy.") + "</p>";
    var rows = n.alt.map(function (a) {
      var cls = a[1] === null ? "" : (a[1] > 0 ? "pos" : "neg");
      var why = [];
      if (a[1] !== null) {
        if (a[2]) why.push("compute " + fmtS(a[2], true));
        a[3].forEach(function (kv) { why.push(esc(kv[0]) + " " + fmtS(kv[1], true)); });
        if (a[4]) why.push("weights " + fmtB(a[4], true) + " per rank");
      }
      if (a[5]) why.push(esc(a[5]));
      return '<div class="alt"><span class="mono">' + esc(a[0]) + '</span><b class="' + cls + '">' +
        (a[1] === null ? "not possible" : fmtS(a[1], true)) + '</b><div class="note">' + why.join("; ") + "</div></div>";
    });
    return rows.join("") + '<p class="note">\u0394 time with the neighbours\u2019 choices held fixed; a weight moves with the op that reads it.</p>';
  }
  function showLeaf(l) {
    var h = [];
    if (l.kind === "coll") {
      var c = l.data;
      h.push("<h1>" + esc(collKind(c)) + "</h1><p class=\"sub\">collective inserted by the rewrite</p>");
      h.push('<div class="kv"><span>tensor</span><b>' + nodeRow(c.p) + "</b><span>placement</span><b>" + tag(c.src) + " \u2192 " + tag(c.dst) +
             "</b><span>steps</span><b class=\"mono\">" + esc(c.steps.join(" \u2192 ")) + "</b><span>bytes</span><b>" + fmtB(c.b) +
             "</b><span>predicted time</span><b>" + fmtS(c.t) + "</b><span>module</span><b class=\"mono\">" + esc(c.m || "(top)") + "</b></div>");
      h.push("<h2>consumers</h2>" + c.c.map(nodeRow).join("<br>"));
    } else {
      var n = l.data;
      h.push("<h1 class=\"mono\">" + esc(n.t || n.n) + "</h1><p class=\"sub\">" + esc(n.op) + (n.t ? " \u00b7 node " + esc(n.n) : "") + "</p>");
      if (n.f) h.push('<p class="pos">No sharding rule for this op: it runs replicated.</p>');
      h.push('<div class="kv"><span>module</span><b class="mono">' + esc(n.m || "(top)") + "</b><span>output</span><b>" + tag(n.o) +
             (n.s.length ? " " + esc(n.s.join("\u00d7")) + " " + esc(n.d) : "") + "</b><span>compute / rank</span><b>" + fmtS(n.c) + "</b>" +
             (n.w !== undefined ? "<span>bytes / rank</span><b>" + fmtB(n.w) + "</b>" : "") + "</div>");
      if (n.i.length) {
        h.push("<h2>inputs</h2><table>" + n.i.map(function (p, k) {
          return '<tr><td class="wrap">' + nodeRow(n.a[k]) + '</td><td class="num">' + tag(DATA.nodes[n.a[k]].o) + " \u2192 " + tag(p) + "</td></tr>";
        }).join("") + "</table>");
      }
      var colls = leaves.filter(function (x) { return x.kind === "coll" && (x.data.p === l.index || x.data.c.indexOf(l.index) >= 0); });
      if (colls.length) h.push("<h2>collectives</h2>" + colls.map(function (x) {
        return '<a href="#" data-goto-coll="' + x.index + '">' + esc(collKind(x.data)) + "</a> " + tag(x.data.src) + "\u2192" + tag(x.data.dst) +
          " " + fmtB(x.data.b) + ", " + fmtS(x.data.t);
      }).join("<br>"));
      var readers = l.outs.map(function (e) { return e.to; });
      if (readers.length) h.push("<h2>read by</h2>" + readers.slice(0, 12).map(function (r) {
        return r.kind === "coll" ? esc(collKind(r.data)) : nodeRow(r.index);
      }).join(", ") + (readers.length > 12 ? " \u2026" : ""));
      h.push("<h2>alternatives</h2>" + altTable(n));
    }
    details.innerHTML = h.join("");
  }
  function showGroup(g) {
    var a = aggregate(g), h = [];
    h.push("<h1>" + esc(groupLabel(g)) + "</h1><p class=\"sub mono\">" + esc(g.fqn || "(whole model)") + "</p>");
    if (g.kind === "fold") h.push("<p>" + g.count + " consecutive layers with the same plan; their figures below are the sum over all " +
                                   g.count + ". <button data-unfold=\"" + g.id + "\">unfold</button></p>");
    h.push('<div class="kv"><span>ops</span><b>' + a.ops + "</b><span>compute / rank</span><b>" + fmtS(a.compute) +
           "</b><span>communication</span><b>" + fmtS(a.comm) + "</b><span>weights / rank</span><b>" + fmtB(a.weightBytes) + "</b></div>");
    var w = Object.keys(a.weights);
    var ws = a.leaves.filter(function (l) { return l.kind === "node" && l.data.w !== undefined; });
    if (w.length) h.push("<h2>weights</h2><table>" + ws.slice(0, 60).map(function (l) {
      var t = l.data.t, rel = g.fqn && t.indexOf(g.fqn + ".") === 0 ? t.slice(g.fqn.length + 1) : t;
      return "<tr><td>" + tag(l.data.o) + '</td><td class="wrap"><a href="#" class="mono" data-goto="' + esc(l.data.n) + '">' + esc(rel) +
        '</a></td><td class="num">' + fmtB(l.data.w) + "</td></tr>";
    }).join("") + "</table>" + (ws.length > 60 ? "\u2026 " + (ws.length - 60) + " more" : ""));
    var cl = a.leaves.filter(function (l) { return l.kind === "coll"; });
    if (cl.length) h.push("<h2>collectives</h2><table>" + cl.slice(0, 40).map(function (l) {
      return '<tr><td><a href="#" data-goto-coll="' + l.index + '">' + esc(collKind(l.data)) + "</a></td><td>" + tag(l.data.src) + "\u2192" +
        tag(l.data.dst) + '</td><td class="num">' + fmtB(l.data.b) + '</td><td class="num">' + fmtS(l.data.t) + "</td></tr>";
    }).join("") + "</table>" + (cl.length > 40 ? "\u2026 " + (cl.length - 40) + " more" : ""));
    details.innerHTML = h.join("");
  }
  function select(item) {
    selectedId = item ? item.id : null;
    if (!item) return;
    if (item.kind === "node" || item.kind === "coll") showLeaf(item); else showGroup(item);
  }

  // ------------------------------------------------------------------ navigation
  function reveal(leaf) {
    var chain = chainOf(leaf);
    chain.forEach(function (g, i) {
      if (i === chain.length - 1) return;
      g.expanded = true;
      if (g.kind === "fold" && chain[i + 1] !== g.rep) g.unfolded = true;  // a hidden layer: show them all
    });
    // Unfolding changes the chain: expand again along the new one.
    chainOf(leaf).forEach(function (g, i, c) { if (i < c.length - 1) g.expanded = true; });
  }
  function goTo(leaf, noScroll) {
    if (!leaf || leaf.hidden) return false;
    reveal(leaf);
    select(leaf);
    render();
    var el = svgHost.querySelector('[data-id="' + leaf.id + '"]');
    if (el && el.scrollIntoView && !noScroll) el.scrollIntoView({ block: "center", inline: "center" });
    return true;
  }
  function find(text) {
    text = text.trim();
    if (!text) return null;
    var exact = leaves.filter(function (l) { return l.kind === "node" && !l.hidden && (l.data.n === text || l.data.t === text); });
    if (exact.length) return exact[0];
    var low = text.toLowerCase();
    var loose = leaves.filter(function (l) {
      return l.kind === "node" && !l.hidden && ((l.data.t || "").toLowerCase().indexOf(low) >= 0 || l.data.n.toLowerCase().indexOf(low) >= 0);
    });
    return loose[0] || null;
  }
  function setAll(expanded) {
    groups.forEach(function (g) { if (g !== root) g.expanded = expanded; });
  }
  function defaultView() {
    setAll(false);
    root.expanded = true;
    // Open the path to the first layer (or fold) and its attention / MLP, so the page opens on something useful.
    var firstLayer = null;
    groups.forEach(function (g) {
      if (firstLayer || g.kind !== "module" || !/\.\d+$/.test(g.fqn)) return;
      firstLayer = g;
    });
    function openUp(g) { while (g) { g.expanded = true; if (g.fold && !g.fold.unfolded) g.fold.expanded = true; g = g.parent; } }
    groups.forEach(function (g) {
      if (g.kind === "module" && g.parent === root) g.expanded = true;
      if (g.kind === "module" && g.parent && g.parent.parent === root && g.children.length && !/\.\d+$/.test(g.fqn)) g.expanded = true;
    });
    if (firstLayer) {
      openUp(firstLayer);
      firstLayer.children.forEach(function (c) {
        if (c.kind === "module" && c.children.length) c.expanded = true;
      });
    }
  }

  // ------------------------------------------------------------------ sidebar
  function sidebar() {
    var t = META.predicted_compute_s + META.predicted_comm_s;
    var cshare = t ? 100 * META.predicted_compute_s / t : 0;
    var total = META.parameter_bytes_total || 1;
    var memShare = 100 * META.parameter_bytes_per_rank / total;
    var budget = META.memory_budget_bytes ? Math.min(100, 100 * META.memory_budget_bytes / total) : null;
    var counts = Object.keys(META.collective_counts).sort().map(function (k) {
      return "<span>" + esc(k) + "</span><b>\u00d7" + META.collective_counts[k] + "</b>";
    }).join("");
    var h = [];
    h.push("<h1>" + esc(META.title) + "</h1><p class=\"sub\">tp=" + META.world_size + " on " + esc(META.hardware) + " \u00b7 plan v" +
           META.version + " \u00b7 graph " + esc(META.fingerprint) + "</p>");
    h.push("<h2>predicted forward pass</h2><div class=\"big\">" + fmtS(t) + "</div>");
    h.push('<div class="bar" title="compute vs communication"><span style="width:' + cshare.toFixed(1) + '%;background:#1971c2"></span>' +
           '<span style="width:' + (100 - cshare).toFixed(1) + '%;background:#c92a2a"></span></div>');
    h.push('<div class="kv"><span>\u25a0 compute</span><b style="color:#1971c2">' + fmtS(META.predicted_compute_s) +
           '</b><span>\u25a0 communication</span><b style="color:#c92a2a">' + fmtS(META.predicted_comm_s) + "</b></div>");
    h.push("<h2>weights per rank</h2><div class=\"big\">" + fmtB(META.parameter_bytes_per_rank) + "</div>");
    h.push('<div class="bar" title="per rank / whole model"><span style="width:' + memShare.toFixed(1) + '%;background:#2f9e44"></span>' +
           (budget !== null ? '<span class="budget" style="left:' + budget.toFixed(1) + '%"></span>' : "") + "</div>");
    h.push('<div class="kv"><span>whole model</span><b>' + fmtB(META.parameter_bytes_total) + "</b><span>share</span><b>" + memShare.toFixed(1) +
           "%</b><span>budget</span><b>" + (META.memory_budget_bytes ? fmtB(META.memory_budget_bytes) : "none") + "</b></div>");
    h.push("<h2>collectives per forward</h2><div class=\"kv\">" + (counts || "<span>none</span><b></b>") + "</div>");
    if (META.fallback_ops.length) h.push('<h2>no sharding rule (replicated)</h2><p class="pos mono">' + META.fallback_ops.map(esc).join("<br>") + "</p>");
    h.push('<h2>find</h2><input type="search" id="search" placeholder="node name or parameter FQN, Enter">' +
           '<div id="search-result" class="note"></div>');
    h.push('<h2>view</h2><div class="buttons"><button data-act="default">default</button><button data-act="expand">expand all</button>' +
           '<button data-act="collapse">collapse all</button><button data-act="unfold">unfold layers</button><button data-act="fold">fold layers</button>' +
           '<button data-act="zoom-out">\u2212</button><button data-act="zoom-in">+</button></div><p class="note" id="visible-count"></p>');
    h.push("<h2>placement legend</h2><div class=\"legend\">" +
           [["R", "replicated: every rank holds it all"], ["S(0)", "split along dim 0"], ["S(1)", "split along dim 1"], ["S(2)", "split along dim 2"],
            ["P", "partial sum: ranks hold addends"]].map(function (kv) {
             return '<span class="sw" style="border-color:' + colour(kv[0]) + ";background:" + tint(kv[0]) + '"></span><span><b class="mono">' +
               kv[0] + "</b> " + kv[1] + "</span>";
           }).join("") + '<span class="sw" style="border-color:#c92a2a;background:#fff5f5"></span><span>collective (bytes \u00b7 time)</span>' +
           '<span class="sw" style="border-color:#6741d9;border-style:dashed"></span><span>identical layers, folded</span></div>');
    h.push('<p class="note">Click a box to open or close it, a node for its strategy and alternatives. Edges are coloured by the placement of the tensor they carry.</p>');
    document.getElementById("sidebar").innerHTML = h.join("");
  }

  // ------------------------------------------------------------------ events
  var tooltip = document.getElementById("tooltip");
  function itemOf(target) {
    var el = target && target.closest ? target.closest("[data-id]") : null;
    return el ? { el: el, item: drawn[el.getAttribute("data-id")] } : null;
  }
  function tooltipText(item) {
    if (item.kind === "coll") {
      var c = item.data;
      return collKind(c) + " " + c.src + " \u2192 " + c.dst + "\n" + fmtB(c.b) + " \u00b7 " + fmtS(c.t) + "\nof " + DATA.nodes[c.p].n;
    }
    if (item.kind === "node") {
      var n = item.data, best = n.alt.length ? n.alt[0] : null;
      return (n.t || n.n) + "  (" + n.op + ")\n" + (n.i.length ? "(" + n.i.join(", ") + ") \u2192 " : "") + n.o +
        (n.s.length ? "   " + n.s.join("\u00d7") : "") + (n.c ? "\ncompute " + fmtS(n.c) : "") +
        (best ? "\nnext best: " + best[0] + " " + (best[1] === null ? "(not possible)" : fmtS(best[1], true)) : "");
    }
    var st = groupStats(item);
    return groupLabel(item) + "\n" + st.text + (st.colls ? "\n" + st.colls : "") + "\n" + st.time + (item.expanded ? "" : "\nclick to open");
  }
  svgHost.addEventListener("click", function (ev) {
    var hit = itemOf(ev.target);
    if (!hit || !hit.item) return;
    var item = hit.item;
    if (item.kind === "node" || item.kind === "coll") { select(item); render(); return; }
    item.expanded = !item.expanded;
    select(item);
    render();
  });
  svgHost.addEventListener("mousemove", function (ev) {
    var hit = itemOf(ev.target);
    if (!hit || !hit.item) { tooltip.style.display = "none"; return; }
    tooltip.textContent = tooltipText(hit.item);
    tooltip.style.display = "block";
    tooltip.style.left = Math.min(ev.clientX + 14, window.innerWidth - 430) + "px";
    tooltip.style.top = (ev.clientY + 14) + "px";
  });
  svgHost.addEventListener("mouseleave", function () { tooltip.style.display = "none"; });
  document.addEventListener("click", function (ev) {
    var t = ev.target;
    if (!t || !t.getAttribute) return;
    if (t.hasAttribute("data-goto")) { ev.preventDefault(); goTo(byName[t.getAttribute("data-goto")]); }
    else if (t.hasAttribute("data-goto-coll")) { ev.preventDefault(); goTo(leaves.filter(function (l) { return l.kind === "coll" && l.index === +t.getAttribute("data-goto-coll"); })[0]); }
    else if (t.hasAttribute("data-unfold")) {
      var g = groups.filter(function (x) { return x.id === t.getAttribute("data-unfold"); })[0];
      if (g) { g.unfolded = true; g.members.forEach(function (m) { m.expanded = false; }); render(); }
    } else if (t.hasAttribute("data-act")) {
      var act = t.getAttribute("data-act");
      if (act === "default") defaultView();
      if (act === "expand") setAll(true);
      if (act === "collapse") { setAll(false); root.expanded = true; }
      if (act === "unfold") groups.forEach(function (x) { if (x.kind === "fold") x.unfolded = true; });
      if (act === "fold") groups.forEach(function (x) { if (x.kind === "fold") x.unfolded = false; });
      if (act === "zoom-in") zoom = Math.min(3, zoom * 1.25);
      if (act === "zoom-out") zoom = Math.max(0.2, zoom / 1.25);
      render();
    }
  });
  function bindSearch() {
    var box = document.getElementById("search");
    box.addEventListener("keydown", function (ev) {
      if (ev.key !== "Enter") return;
      var leaf = find(box.value);
      document.getElementById("search-result").textContent = leaf ? "" : "nothing matches \u201c" + box.value + "\u201d";
      if (leaf) goTo(leaf);
    });
  }

  // ------------------------------------------------------------------ start
  groups.forEach(function (g) {
    if (g.kind === "fold") g.label = g.name + "  \u00d7" + g.count + " identical";
  });
  sidebar();
  bindSearch();
  defaultView();
  // URL hash for links and tests: #select=<name>, #find=<text>, #view=expand|collapse|unfold, #noscroll=1.
  var hash = decodeURIComponent((location.hash || "").slice(1));
  var noScroll = /(^|&)noscroll=1/.test(hash);
  hash.split("&").forEach(function (part) {
    var kv = part.split("=");
    if (kv[0] === "view" && kv[1] === "expand") setAll(true);
    if (kv[0] === "view" && kv[1] === "collapse") { setAll(false); root.expanded = true; }
    if (kv[0] === "view" && kv[1] === "unfold") groups.forEach(function (x) { if (x.kind === "fold") { x.unfolded = true; } });
  });
  render();
  hash.split("&").forEach(function (part) {
    var kv = part.split("=");
    if ((kv[0] === "select" || kv[0] === "find") && kv[1]) goTo(kv[0] === "select" ? byName[kv[1]] || find(kv[1]) : find(kv[1]), noScroll);
  });
  if (!selectedId) showGroup(root);
  document.documentElement.setAttribute("data-autotp-ready", "1");
})();
